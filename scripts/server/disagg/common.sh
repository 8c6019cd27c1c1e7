# shellcheck shell=bash
# Shared body of the start scripts beside this file; sourced by them, not run on its own.
#
# A start script calls:   diffring_run_group GROUP CONFIG_SUBDIR LIGHTX2V_MODEL_VAR
# e.g.                    diffring_run_group wan_t2v wan WAN_T2V_MODEL_PATH
#
# It starts the controller, waits for its /health, starts one encoder, one transformer and
# one decoder, waits until each is registered with the controller and each metrics port
# answers, prints the URLs and stays in the foreground. Ctrl+C (SIGINT), SIGTERM or SIGHUP
# stops the group by the pids started here: workers first (SIGTERM, so they drain), then the
# controller, SIGKILL after STOP_TIMEOUT. A second Ctrl+C kills at once. If a service dies,
# its log tail is printed and the rest of the group is stopped. (Started with `&` from a
# non-interactive shell, the script inherits SIGINT as ignored and bash cannot trap it: use
# SIGTERM there.)
#
# Environment (all optional except the model path):
#   model_path               model folder (diffusers format); LightX2V's variable for the
#                            example (WAN_T2V_MODEL_PATH, WAN_I2V_MODEL_PATH,
#                            QWEN_IMAGE_MODEL_PATH) is accepted too; model_path wins
#   ENCODER_GPU, TRANSFORMER_GPU, DECODER_GPU
#                            a GPU index (N -> --device cuda:N), cuda:N, or cpu. LightX2V's
#                            GPU_ENCODER / GPU_TRANSFORMER / GPU_DECODER are accepted too.
#                            Unset: encoder and decoder on GPU 0, transformer on GPU 1 when
#                            two or more GPUs are visible to torch (else GPU 0); cpu when
#                            none is visible.
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
#   DIFFRING_CLUSTER_TOKEN   shared secret; unset: a fresh one per run, saved (mode 600) in
#                            LOG_DIR/cluster_token for workers started by hand

DIFFRING_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
DIFFRING_TOOL=(-m scripts.server.disagg.group_tool)  # run from $DIFFRING_ROOT
DIFFRING_WORKERS=(encoder transformer decoder)

declare -A DR_PID=()      # role -> pid of the service started by this script
declare -A DR_LOG=()      # role -> log file
DR_HELPER_PID=""          # the readiness waiter or the monitor's sleep, when one runs
DR_STOPPING=0
DR_READY=0

# Never fatal: the terminal or pipe behind stderr may be gone, and the group must still be
# stopped in order.
dr_say() { printf '[%s] %s\n' "$DR_GROUP" "$*" >&2 || true; }
dr_die() { dr_say "error: $*"; exit 1; }

dr_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

dr_pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        DR_PY="$PYTHON"
    elif [[ -x "$DIFFRING_ROOT/.venv/bin/python" ]]; then
        DR_PY="$DIFFRING_ROOT/.venv/bin/python"
    else
        DR_PY="$(command -v python3)" || dr_die "no python3 found; set PYTHON=/path/to/python"
    fi
}

# Device of one stage from its GPU variable (see the header); $2 is the default GPU index.
dr_device() {
    local value="$1" default_gpu="$2"
    if [[ -z "$value" ]]; then
        if (( DR_GPU_COUNT == 0 )); then
            echo cpu
        else
            echo "cuda:$(( default_gpu < DR_GPU_COUNT ? default_gpu : 0 ))"
        fi
    elif [[ "$value" == cpu ]]; then
        echo cpu
    elif [[ "$value" =~ ^[0-9]+$ ]]; then
        echo "cuda:$value"
    elif [[ "$value" =~ ^cuda:[0-9]+$ ]]; then
        echo "$value"
    else
        return 1
    fi
}

dr_resolve_devices() {
    local enc="${ENCODER_GPU:-${GPU_ENCODER:-}}"
    local trf="${TRANSFORMER_GPU:-${GPU_TRANSFORMER:-}}"
    local dec="${DECODER_GPU:-${GPU_DECODER:-}}"
    DR_GPU_COUNT=0
    if [[ -z "$enc" || -z "$trf" || -z "$dec" ]]; then
        # Ask the torch the services will use: a CPU-only build sees no GPU even where
        # nvidia-smi lists some, and then cuda:N would fail in every worker.
        DR_GPU_COUNT="$("$DR_PY" -c 'import torch; print(torch.cuda.device_count())' \
            2>/dev/null || echo 0)"
        [[ "$DR_GPU_COUNT" =~ ^[0-9]+$ ]] || DR_GPU_COUNT=0
    fi
    declare -gA DR_DEVICE=()
    DR_DEVICE[encoder]="$(dr_device "$enc" 0)" || dr_die "ENCODER_GPU=$enc: give N, cuda:N or cpu"
    DR_DEVICE[transformer]="$(dr_device "$trf" 1)" \
        || dr_die "TRANSFORMER_GPU=$trf: give N, cuda:N or cpu"
    DR_DEVICE[decoder]="$(dr_device "$dec" 0)" || dr_die "DECODER_GPU=$dec: give N, cuda:N or cpu"
}

# An absolute path for $1 (empty stays empty), relative ones taken from $2 (default: the
# caller's working directory).
dr_abs() {
    local path="$1" base="${2:-$DR_CALLER_PWD}"
    if [[ -z "$path" || "$path" == /* ]]; then
        printf '%s\n' "$path"
    else
        printf '%s\n' "$base/$path"
    fi
}

dr_log_tail() {
    local role="$1" rc="$2"
    dr_say "$role (pid ${DR_PID[$role]}) exited with status $rc; last lines of ${DR_LOG[$role]}:"
    tail -n 40 "${DR_LOG[$role]}" >&2 || true
}

# Wait up to $1 seconds for the given pids to exit; prints the ones still running.
dr_wait_gone() {
    local timeout="$1"; shift
    local deadline=$(( SECONDS + timeout )) pid left
    while :; do
        left=()
        for pid in "$@"; do
            if dr_alive "$pid"; then left+=("$pid"); fi
        done
        if (( ${#left[@]} == 0 || SECONDS >= deadline )); then
            echo "${left[*]}"
            return 0
        fi
        sleep 0.2
    done
}

dr_stop_pids() {
    local what="$1" grace="$2"; shift 2
    local pid left=()
    (( $# )) || return 0
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    read -ra left <<<"$(dr_wait_gone "$grace" "$@")"
    if (( ${#left[@]} )); then
        dr_say "$what still running after ${grace} s: SIGKILL ${left[*]}"
        for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
        dr_wait_gone 5 "${left[@]}" >/dev/null
    fi
}

# Stop everything this script started, workers first. Idempotent.
dr_stop_group() {
    (( DR_STOPPING )) && return 0
    DR_STOPPING=1
    if dr_alive "$DR_HELPER_PID"; then kill -TERM "$DR_HELPER_PID" 2>/dev/null || true; fi
    # Before the group is ready no worker holds a task, so there is nothing to drain: a
    # start-up that is aborted should not wait the full STOP_TIMEOUT on a loading model.
    local grace="$STOP_TIMEOUT"
    if (( ! DR_READY && grace > 5 )); then grace=5; fi
    local role pids=()
    for role in "${DIFFRING_WORKERS[@]}"; do
        if dr_alive "${DR_PID[$role]:-}"; then pids+=("${DR_PID[$role]}"); fi
    done
    if (( ${#pids[@]} )); then
        dr_say "stopping workers (SIGTERM, they finish their claimed task): ${pids[*]}"
        dr_stop_pids workers "$grace" "${pids[@]}"
    fi
    if dr_alive "${DR_PID[controller]:-}"; then
        dr_say "stopping controller: ${DR_PID[controller]}"
        dr_stop_pids controller "$grace" "${DR_PID[controller]}"
    fi
    dr_say "group stopped"
}

dr_kill_all_now() {
    local pid
    for pid in "${DR_PID[@]}" "$DR_HELPER_PID"; do
        if dr_alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
}

dr_on_signal() {
    local sig="$1" code="$2"
    if (( DR_STOPPING )); then
        dr_say "second $sig: killing the group now"
        dr_kill_all_now
        exit "$code"
    fi
    dr_say "$sig received"
    dr_stop_group
    exit "$code"
}

dr_start_service() {
    local role="$1"; shift
    local log="$DR_LOG_DIR/$role.log"
    if [[ -f "$log" ]]; then mv -f "$log" "$log.prev"; fi
    DR_LOG[$role]="$log"
    # setsid: the service gets its own session, so a Ctrl+C in the terminal reaches only
    # this script, which then stops the group in order (workers before the controller).
    # setsid does not fork here (a background child is no process-group leader), and
    # setpriv execs too, so $! is the service's own pid. --pdeathsig: should this script be
    # SIGKILLed, its services get SIGTERM instead of running on as orphans.
    PYTHONUNBUFFERED=1 setsid "${DR_PDEATH[@]}" "$DR_PY" "$DIFFRING_ROOT/run_service.py" \
        --service "$role" "$@" </dev/null >"$log" 2>&1 &
    DR_PID[$role]=$!
    printf '%s %s\n' "$role" "${DR_PID[$role]}" >>"$DR_PIDS_FILE"
    dr_say "started $role (pid ${DR_PID[$role]}), log $log"
}

# Run the readiness waiter in the background and `wait` for it, so that a signal is
# handled at once instead of after the waiter returns.
dr_wait_ready() {
    local rc=0
    "$DR_PY" "${DIFFRING_TOOL[@]}" wait "$@" &
    DR_HELPER_PID=$!
    wait "$DR_HELPER_PID" || rc=$?
    DR_HELPER_PID=""
    if (( rc == 0 )); then return 0; fi
    local role found=0 status
    for role in controller "${DIFFRING_WORKERS[@]}"; do
        if [[ -n "${DR_PID[$role]:-}" ]] && ! dr_alive "${DR_PID[$role]}"; then
            status=0
            wait "${DR_PID[$role]}" 2>/dev/null || status=$?
            dr_log_tail "$role" "$status"
            found=1
        fi
    done
    if (( ! found )); then
        for role in "${!DR_LOG[@]}"; do
            dr_say "last lines of ${DR_LOG[$role]}:"
            tail -n 10 "${DR_LOG[$role]}" >&2 || true
        done
    fi
    dr_say "start-up failed; stopping the rest of the group"
    dr_stop_group
    exit 1
}

diffring_run_group() {
    DR_GROUP="$1"
    local subdir="$2" lightx2v_var="$3"
    # Paths from the environment are the caller's, relative to where the script was started;
    # the services run from the repository root.
    DR_CALLER_PWD="$PWD"
    cd "$DIFFRING_ROOT" || exit 1

    local model
    model="$(dr_abs "${model_path:-${!lightx2v_var:-}}")"
    [[ -n "$model" ]] || dr_die "no model folder: run as  model_path=/path/to/model bash $0" \
        "(or set $lightx2v_var)"
    [[ -d "$model" ]] || dr_die "model_path $model is not a folder"
    model="$(cd "$model" && pwd)"

    PORT_OFFSET="${PORT_OFFSET:-0}"
    [[ "$PORT_OFFSET" =~ ^-?[0-9]+$ ]] || dr_die "PORT_OFFSET=$PORT_OFFSET is not an integer"
    STOP_TIMEOUT="${STOP_TIMEOUT:-30}"
    [[ "$STOP_TIMEOUT" =~ ^[0-9]+$ ]] || dr_die "STOP_TIMEOUT=$STOP_TIMEOUT: give whole seconds"
    local ready_timeout="${READY_TIMEOUT:-600}" metrics_timeout="${METRICS_TIMEOUT:-15}"
    [[ "$ready_timeout" =~ ^[0-9]+(\.[0-9]+)?$ ]] \
        || dr_die "READY_TIMEOUT=$ready_timeout: give seconds"
    [[ "$metrics_timeout" =~ ^[0-9]+(\.[0-9]+)?$ ]] \
        || dr_die "METRICS_TIMEOUT=$metrics_timeout: give seconds"
    local config_dir output_dir
    config_dir="$(dr_abs "${CONFIG_DIR:-$DIFFRING_ROOT/configs/disagg/$subdir}")"
    output_dir="$(dr_abs "${OUTPUT_DIR:-}")"
    DR_LOG_DIR="$(dr_abs "${LOG_DIR:-$DIFFRING_ROOT/out/logs/$DR_GROUP}")"
    mkdir -p "$DR_LOG_DIR"
    DR_LOG_DIR="$(cd "$DR_LOG_DIR" && pwd)"
    DR_PIDS_FILE="$DR_LOG_DIR/pids"

    dr_pick_python
    dr_resolve_devices
    command -v setsid >/dev/null || dr_die "setsid (util-linux) is needed"
    DR_PDEATH=()
    if setpriv --pdeathsig TERM true 2>/dev/null; then DR_PDEATH=(setpriv --pdeathsig TERM --); fi

    local assignments
    assignments="$("$DR_PY" "${DIFFRING_TOOL[@]}" prepare --group "$DR_GROUP" \
        --config-dir "$config_dir" --log-dir "$DR_LOG_DIR" --port-offset "$PORT_OFFSET" \
        --output-dir "$output_dir")" || exit 1
    # Values are shlex-quoted by group_tool.py; names are GROUP_* only.
    eval "$assignments"

    MOONCAKE_CONFIG_PATH="$(dr_abs \
        "${MOONCAKE_CONFIG_PATH:-$DIFFRING_ROOT/configs/mooncake_config.json}")"
    [[ -f "$MOONCAKE_CONFIG_PATH" ]] \
        || dr_die "MOONCAKE_CONFIG_PATH=$MOONCAKE_CONFIG_PATH: no such file"
    export MOONCAKE_CONFIG_PATH
    if [[ -z "${DIFFRING_CLUSTER_TOKEN:-}" ]]; then
        DIFFRING_CLUSTER_TOKEN="$("$DR_PY" -c 'import secrets; print(secrets.token_hex(16))')"
        export DIFFRING_CLUSTER_TOKEN
        (umask 077 && printf '%s\n' "$DIFFRING_CLUSTER_TOKEN" >"$DR_LOG_DIR/cluster_token")
    fi

    : >"$DR_PIDS_FILE"
    trap 'dr_on_signal INT 130' INT
    trap 'dr_on_signal TERM 143' TERM
    trap 'dr_on_signal HUP 129' HUP  # terminal closed: the services would not notice
    trap '' PIPE  # a reader of our output that goes away must not kill us mid-shutdown
    trap 'dr_stop_group' EXIT

    dr_say "model $model; devices: encoder ${DR_DEVICE[encoder]}," \
        "transformer ${DR_DEVICE[transformer]}, decoder ${DR_DEVICE[decoder]}"
    (( PORT_OFFSET == 0 )) || dr_say "PORT_OFFSET=$PORT_OFFSET: configs in $DR_LOG_DIR/config"

    # shellcheck disable=SC2154  # GROUP_* come from the eval above
    dr_start_service controller --config "$GROUP_CONFIG_controller"
    dr_wait_ready --url "$GROUP_FRONT_URL" --roles "" --timeout "$ready_timeout" \
        --metrics-timeout 0 --pid "controller=${DR_PID[controller]}"

    local role metrics_args=() pid_args=()
    for role in "${DIFFRING_WORKERS[@]}"; do
        local cfg_var="GROUP_CONFIG_$role"
        dr_start_service "$role" --config "${!cfg_var}" --model_path "$model" \
            --device "${DR_DEVICE[$role]}"
    done
    for role in controller "${DIFFRING_WORKERS[@]}"; do
        local metrics_var="GROUP_METRICS_$role"
        metrics_args+=(--metrics "$role=${!metrics_var}")
        pid_args+=(--pid "$role=${DR_PID[$role]}")
    done
    local strict=()
    if [[ "${METRICS_REQUIRED:-0}" == 1 ]]; then strict=(--metrics-required); fi
    dr_wait_ready --url "$GROUP_FRONT_URL" --timeout "$ready_timeout" \
        --metrics-timeout "$metrics_timeout" "${metrics_args[@]}" "${pid_args[@]}" \
        "${strict[@]}"

    DR_READY=1
    local kind=image
    if [[ "$DR_GROUP" == wan_* ]]; then kind=video; fi
    cat >&2 <<EOF || true
[$DR_GROUP] group ready
  front door  $GROUP_FRONT_URL   (POST /v1/tasks/$kind/, GET /v1/tasks/{id}/status)
  API docs    $GROUP_FRONT_URL/docs
  metrics     controller  ${GROUP_METRICS_controller:-off}
              encoder     ${GROUP_METRICS_encoder:-off}
              transformer ${GROUP_METRICS_transformer:-off}
              decoder     ${GROUP_METRICS_decoder:-off}
  results     $GROUP_OUTPUT_DIR
  logs        $DR_LOG_DIR   (pids: $DR_PIDS_FILE)
  try         $DR_PY -m scripts.post.post_$DR_GROUP --url $GROUP_FRONT_URL --prompt '...'
Ctrl+C stops the group.
EOF

    # Stay in the foreground. `sleep & wait` rather than a plain sleep, so that a signal
    # runs its trap at once.
    while :; do
        for role in controller "${DIFFRING_WORKERS[@]}"; do
            if ! dr_alive "${DR_PID[$role]}"; then
                local status=0
                wait "${DR_PID[$role]}" 2>/dev/null || status=$?
                dr_log_tail "$role" "$status"
                dr_say "$role is gone; stopping the group"
                dr_stop_group
                exit 1
            fi
        done
        sleep 1 &
        DR_HELPER_PID=$!
        wait "$DR_HELPER_PID" || true
        DR_HELPER_PID=""
    done
}
