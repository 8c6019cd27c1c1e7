#!/usr/bin/env bash
# Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline), one to several input images:
# controller + encoder + transformer + decoder on this machine.
#
#   model_path=/path/to/Qwen-Image-Edit-2511 bash scripts/server/disagg/qwen/start_qwen_i2i_plus_disagg.sh
#   ENCODER_GPU=0 TRANSFORMER_GPU=1 DECODER_GPU=0 model_path=... \
#       bash scripts/server/disagg/qwen/start_qwen_i2i_plus_disagg.sh
#
# Configs: configs/disagg/qwen/qwen_i2i_plus_{controller,encoder,transformer,decoder}.json.
# Every other knob (PORT_OFFSET, LOG_DIR, OUTPUT_DIR, ...) is described in ../common.sh.
# Ctrl+C stops the whole group.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
diffring_run_group qwen_i2i_plus qwen QWEN_IMAGE_MODEL_PATH
