#!/usr/bin/env bash
# Wan2.2-I2V-A14B image-to-video (two experts): controller + encoder + transformer + decoder on this machine.
#
#   model_path=/path/to/model bash scripts/server/disagg/wan/start_wan22_a14b_i2v_disagg.sh
#
# Configs: configs/disagg/wan/wan22_a14b_i2v_{controller,encoder,transformer,decoder}.json.
# Split placement (one expert per DiT worker: a high-noise and a low-noise one, each on its GPU):
#   EXPERTS=split TRANSFORMER_GPU=1,2 model_path=/path/to/model bash scripts/server/disagg/wan/start_wan22_a14b_i2v_disagg.sh
# from wan22_a14b_i2v_transformer_{high,low}.json in place of the transformer's file.
# Every other knob (PORT_OFFSET, LOG_DIR, OUTPUT_DIR, ...) is described in ../common.sh.
# Ctrl+C stops the whole group.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
diffring_run_group wan22_a14b_i2v wan WAN_I2V_MODEL_PATH
