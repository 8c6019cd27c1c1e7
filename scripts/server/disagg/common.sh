# shellcheck shell=bash
# Shared body of the start scripts beside this file; sourced by them, not run on its own.
#
# A start script calls:   diffring_run_group GROUP CONFIG_SUBDIR LIGHTX2V_MODEL_VAR
# e.g.                    diffring_run_group wan_t2v wan WAN_T2V_MODEL_PATH
#
# It turns the environment below into the options of the one launcher,
# `python -m launcher` (launcher/launch.py), and execs it: it starts the
# controller, waits for its /health, starts one encoder, one transformer and one decoder,
# waits until each is registered with the controller and each metrics port answers, prints
# the URLs and stays in the foreground. Ctrl+C (SIGINT), SIGTERM or SIGHUP stops the group by
# the pids it started: workers first (SIGTERM, so they drain), then the controller, SIGKILL
# after STOP_TIMEOUT. A second Ctrl+C kills at once. If a service dies, its log tail is
# printed and the rest of the group is stopped. Every service runs in a session of its own,
# so a Ctrl+C in the terminal reaches only the launcher.
#
# Environment (all optional except the model path):
#   model_path               model folder (diffusers or original Wan2.1 layout); LightX2V's
#                            variable for the example (WAN_T2V_MODEL_PATH, WAN_I2V_MODEL_PATH,
#                            QWEN_IMAGE_MODEL_PATH) is accepted too; model_path wins
#   ENCODER_GPU, TRANSFORMER_GPU, DECODER_GPU
#                            a GPU index (N -> --device cuda:N), cuda:N, or cpu. LightX2V's
#                            GPU_ENCODER / GPU_TRANSFORMER / GPU_DECODER are accepted too.
#                            Unset: encoder and decoder on GPU 0, transformer on GPU 1 when
#                            two or more GPUs are visible to torch (else GPU 0); cpu when
#                            none is visible.
#   EXPERTS=split            Wan2.2-A14B only: the split placement, one expert per DiT
#                            worker: one high-noise and one low-noise DiT worker, from
#                            GROUP_transformer_high.json and GROUP_transformer_low.json
#                            (in place of GROUP_transformer.json). TRANSFORMER_GPU=HIGH,LOW
#                            (e.g. 1,2) puts each on its GPU; one value: both there; unset:
#                            GPUs 1 and 2. (both / swap are transformer.experts in the
#                            transformer's role file, no variable.)
#   PORT_OFFSET              added to every port of the group (default 0)
#   LOG_DIR                  logs, pids file, effective configs (default out/logs/GROUP)
#   OUTPUT_DIR               results folder (default: output_dir of the config files)
#   CONFIG_DIR               folder of the four role files (default configs/disagg/SUBDIR)
#   PYTHON                   interpreter (default .venv/bin/python, else python3)
#   READY_TIMEOUT            seconds to wait for the group to be ready (default 600)
#   METRICS_TIMEOUT          extra seconds to wait for /metrics once the services are up
#                            (default 15); METRICS_REQUIRED=1 makes a silent one fatal
#   STOP_TIMEOUT             seconds each shutdown phase may take before SIGKILL (default 30)
#   MOONCAKE_CONFIG_PATH     default configs/mooncake_config.json
#   LIGHTX2V_PORTS=1         also open LightX2V's per-stage API ports (its request scripts'
#                            table; the front door moves to the encoder's port), so that
#                            its three-POST request scripts work unchanged
#   CONFIG_DIR may hold LightX2V's own stage configs (<prefix>_disagg_{encoder,transformer,
#                            decode}.json): they are read as they are (docs/from-lightx2v.md)
#   DIFFRING_CLUSTER_TOKEN   shared secret; unset: a fresh one per run, saved (mode 600) in
#                            LOG_DIR/cluster_token for workers started by hand
# Relative paths are taken from the directory the script was started in.

diffring_run_group() {
    local group="$1" subdir="$2" lightx2v_var="$3"
    local root py
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
    if [[ -n "${PYTHON:-}" ]]; then
        py="$PYTHON"
    elif [[ -x "$root/.venv/bin/python" ]]; then
        py="$root/.venv/bin/python"
    else
        py="$(command -v python3)" \
            || { echo "[$group] error: no python3 found; set PYTHON=/path/to/python" >&2; exit 1; }
    fi
    local model="${model_path:-${!lightx2v_var:-}}"
    if [[ -z "$model" ]]; then
        echo "[$group] error: no model folder: run as  model_path=/path/to/model bash $0" \
            "(or set $lightx2v_var)" >&2
        exit 1
    fi
    local args=(--group "$group" --model-path "$model"
                --config-dir "${CONFIG_DIR:-$root/configs/disagg/$subdir}")
    local enc="${ENCODER_GPU:-${GPU_ENCODER:-}}" trf="${TRANSFORMER_GPU:-${GPU_TRANSFORMER:-}}"
    local dec="${DECODER_GPU:-${GPU_DECODER:-}}"
    [[ -z "$enc" ]] || args+=(--encoder-device "$enc")
    [[ -z "$trf" ]] || args+=(--transformer-device "$trf")
    [[ -z "$dec" ]] || args+=(--decoder-device "$dec")
    [[ -z "${PORT_OFFSET:-}" ]] || args+=(--port-offset "$PORT_OFFSET")
    [[ -z "${LOG_DIR:-}" ]] || args+=(--log-dir "$LOG_DIR")
    [[ -z "${OUTPUT_DIR:-}" ]] || args+=(--output-dir "$OUTPUT_DIR")
    [[ -z "${READY_TIMEOUT:-}" ]] || args+=(--ready-timeout "$READY_TIMEOUT")
    [[ -z "${METRICS_TIMEOUT:-}" ]] || args+=(--metrics-timeout "$METRICS_TIMEOUT")
    [[ "${METRICS_REQUIRED:-0}" != 1 ]] || args+=(--metrics-required)
    [[ -z "${STOP_TIMEOUT:-}" ]] || args+=(--stop-timeout "$STOP_TIMEOUT")
    [[ -z "${MOONCAKE_CONFIG_PATH:-}" ]] || args+=(--mooncake-config "$MOONCAKE_CONFIG_PATH")
    [[ "${LIGHTX2V_PORTS:-0}" != 1 ]] || args+=(--lightx2v-ports)
    case "${EXPERTS:-}" in
        "") ;;
        split) args+=(--split) ;;
        *) echo "[$group] error: EXPERTS=${EXPERTS}: the one value is split (both and swap" \
               "are transformer.experts in ${group}_transformer.json)" >&2
           exit 1 ;;
    esac
    # The launcher imports the repository's packages: found from here even when the script is
    # started elsewhere and the project is not installed into $py.
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m launcher "${args[@]}"
}
