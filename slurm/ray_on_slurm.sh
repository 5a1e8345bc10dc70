#!/usr/bin/env bash
# Ray on Slurm: bring up a Ray cluster across the job's nodes, run one megatron-sortedrl command on the head,
# forward the pre-timeout signal so the run checkpoints, requeue, and clean up. Sourced by the sbatch recipes:
#
#   source "$MSRL_HOME/slurm/ray_on_slurm.sh"
#   msrl_launch configs/qwen32b_128gpu.yaml [key=value ...]
#
# Environment (all optional):
#   MSRL_HOME          repository checkout on shared storage (default: the directory above this script)
#   MSRL_PYTHON        python with megatron-sortedrl installed (default: $MSRL_HOME/.venv/bin/python)
#   MSRL_SUBCOMMAND    what the head runs (default: train; `ray-check` only checks the cluster)
#   MSRL_RAY_PORT      GCS port (default: derived from the job id so two jobs on a node do not clash)
#   MSRL_JOIN_TIMEOUT  seconds to wait for every node to join (default 300)
#   MSRL_DRY_RUN=1     print the node list, ports and GPU layout, start nothing
#   MSRL_RAY_START_ARGS extra `ray start` arguments for every node (they come last, so they win)
# Resources: every srun step of the bring-up asks for its node's share of the job (since Slurm 22.05 a step
# inherits no --cpus-per-task, and under cgroup limits a step that asks for nothing gets one core):
# --cpus-per-task from cluster.cpus_per_node (0: Slurm's SLURM_CPUS_ON_NODE), --mem=0 (all the job's memory
# on the node), the job's GPUs (--gpus-per-node as the job asked, else --gres=gpu:N from cluster.gpus_per_node,
# which must match Slurm's SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE when those are set; 0 in the config takes
# Slurm's count), and --exact. Inside the step slurm/ray_node.sh gives `ray start` --num-cpus, --num-gpus
# and --memory from what the step got (its cpuset, CUDA_VISIBLE_DEVICES, its cgroup's memory limit).
# Values are read on the batch host: nodes are assumed alike.
# Sockets: cluster.socket_ifname sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for every node (srun passes
# the environment on, and Ray's workers inherit it) and chooses the head's Ray address (its IPv4 address on that
# interface); empty: whatever the environment has, and the head's first non-loopback address
# (slurm/node_address.sh). MSRL_HEAD_IP overrides the address.
# Ports: the ports Ray would otherwise take from fixed defaults (GCS, client server, dashboard agent) come
# from a per-job block and are passed explicitly; the rest Ray picks free itself. Temp dirs are per job.
set -euo pipefail

MSRL_HOME=${MSRL_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
MSRL_PYTHON=${MSRL_PYTHON:-$MSRL_HOME/.venv/bin/python}
MSRL_SUBCOMMAND=${MSRL_SUBCOMMAND:-train}
MSRL_JOIN_TIMEOUT=${MSRL_JOIN_TIMEOUT:-300}

msrl_die() { echo "ray_on_slurm: $*" >&2; exit 2; }

msrl_ports() {
    local job=${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run this under sbatch/salloc}
    # One block of 40 ports per job (by job id) in 20000-59999: two jobs sharing a node do not clash.
    local base=${MSRL_RAY_PORT:-$((20000 + (job % 1000) * 40))}
    RAY_PORT=$base
    RAY_CLIENT_PORT=$((base + 1))
    RAY_PORT_BASE=$base
}

msrl_ray_start_args() {
    # Ray's fixed defaults (dashboard agent 52365) would clash between jobs, so each node of the job gets
    # its own port from the block; node manager, object manager, metrics and worker ports are left to Ray,
    # which picks free ones itself.
    local node_index=$1
    echo --dashboard-agent-listen-port="$((RAY_PORT_BASE + 2 + node_index))" --disable-usage-stats --block \
        "${MSRL_RAY_START_ARGS:-}"
}

msrl_ray_resources() {
    # Sets MSRL_NODE_CPUS, MSRL_NODE_GPUS and MSRL_SRUN_RESOURCES (what every step asks for) from the
    # config's cluster section and Slurm, and exports the socket interface.
    local out cfg_cpus cfg_gpus cfg_ifname
    out=$("$MSRL_PYTHON" -m megatron_sortedrl layout --ray-resources "$@") || exit 2  # it printed why
    read -r cfg_cpus cfg_gpus cfg_ifname <<< "$out"
    local slurm_gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}
    slurm_gpus=${slurm_gpus##*:}  # --gpus-per-node=a100:8 gives "a100:8"
    local gpus=$cfg_gpus
    if ((cfg_gpus > 0)); then
        if [[ -n "$slurm_gpus" && "$slurm_gpus" != "$cfg_gpus" ]]; then
            msrl_die "cluster.gpus_per_node=$cfg_gpus but Slurm gives $slurm_gpus GPUs per node; set cluster.gpus_per_node=$slurm_gpus or ask sbatch for --gpus-per-node=$cfg_gpus"
        fi
    else
        gpus=${slurm_gpus:-0}
    fi
    local cpus=$cfg_cpus
    if ((cpus > 0)); then
        if [[ -n "${SLURM_CPUS_ON_NODE:-}" ]] && ((cpus > SLURM_CPUS_ON_NODE)); then
            msrl_die "cluster.cpus_per_node=$cpus but Slurm gives $SLURM_CPUS_ON_NODE CPUs per node; set cluster.cpus_per_node=$SLURM_CPUS_ON_NODE (or 0) or ask sbatch for more"
        fi
    else
        cpus=${SLURM_CPUS_ON_NODE:-0}
    fi
    MSRL_NODE_CPUS=$cpus
    MSRL_NODE_GPUS=$gpus
    MSRL_SRUN_RESOURCES=(--mem=0 --exact)
    if ((cpus > 0)); then
        MSRL_SRUN_RESOURCES=(--cpus-per-task="$cpus" "${MSRL_SRUN_RESOURCES[@]}")
    else
        echo "ray_on_slurm: warning: neither cluster.cpus_per_node nor SLURM_CPUS_ON_NODE is set; each node's" \
            "step gets Slurm's default CPUs" >&2
    fi
    if [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then  # as the job asked, GPU type included
        MSRL_SRUN_RESOURCES+=(--gpus-per-node="$SLURM_GPUS_PER_NODE")
    elif ((gpus > 0)); then
        MSRL_SRUN_RESOURCES+=(--gres=gpu:"$gpus")
    fi
    MSRL_SOCKET_IFNAME=
    if [[ "$cfg_ifname" != "-" ]]; then
        export GLOO_SOCKET_IFNAME=$cfg_ifname NCCL_SOCKET_IFNAME=$cfg_ifname
        MSRL_SOCKET_IFNAME=$cfg_ifname  # the head's Ray address is taken on it too
    fi
}

msrl_step() {
    # One task on one node with the node's share of the job (msrl_ray_resources).
    local node=$1
    shift
    srun --nodes=1 --ntasks=1 -w "$node" "${MSRL_SRUN_RESOURCES[@]}" "$@"
}

msrl_ray_node() {
    # `ray start` on one node through slurm/ray_node.sh, which advertises what the step got. Run it with `&`:
    # the exec makes the background job's pid srun's own, so that the cleanup's kill reaches the step.
    local node=$1
    shift
    exec srun --nodes=1 --ntasks=1 -w "$node" "${MSRL_SRUN_RESOURCES[@]}" bash "$MSRL_HOME/slurm/ray_node.sh" \
        "$MSRL_PYTHON" "$node" "$MSRL_NODE_CPUS" "$MSRL_NODE_GPUS" "$@"
}

msrl_cleanup() {
    local status=$?
    trap - EXIT INT TERM
    echo "ray_on_slurm: stopping Ray on ${#MSRL_NODES[@]} nodes"
    local pid
    for pid in "${MSRL_RAY_PIDS[@]:-}"; do
        if [[ -n "$pid" ]]; then kill "$pid" 2>/dev/null || true; fi
    done
    wait 2>/dev/null || true
    exit "$status"
}

msrl_forward_signal() {
    # Slurm sends USR1 (--signal=B:USR1@<s>) before the time limit: the driver checkpoints and exits,
    # then the job is requeued and resumes from that checkpoint (checkpoint.resume=auto).
    echo "ray_on_slurm: pre-timeout signal: asking the driver to checkpoint and requeueing job $SLURM_JOB_ID"
    if [[ -n "${MSRL_DRIVER_PID:-}" ]]; then kill -USR1 "$MSRL_DRIVER_PID" 2>/dev/null || true; fi
    MSRL_REQUEUE=1
}

msrl_launch() {
    local config=${1:?usage: msrl_launch <config.yaml> [key=value ...]}
    shift
    [[ -f "$config" ]] || config="$MSRL_HOME/$config"
    [[ -f "$config" ]] || msrl_die "config file not found: $1"
    mapfile -t MSRL_NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: run this under sbatch}")
    ((${#MSRL_NODES[@]} > 0)) || msrl_die "the allocation has no nodes"
    msrl_ports
    local head=${MSRL_NODES[0]}
    [[ -x "$MSRL_PYTHON" ]] || msrl_die "no python at $MSRL_PYTHON: run 'bash tools/setup_env.sh' in $MSRL_HOME or set MSRL_PYTHON"
    msrl_ray_resources "$config" "cluster.num_nodes=${#MSRL_NODES[@]}" "$@"
    # The head's address on the configured interface, else its first non-loopback one (slurm/node_address.sh).
    local head_ip=${MSRL_HEAD_IP:-}
    if [[ -z "$head_ip" ]]; then
        head_ip=$(msrl_step "$head" bash "$MSRL_HOME/slurm/node_address.sh" "${MSRL_SOCKET_IFNAME:-}") || exit 2
    fi
    local address="$head_ip:$RAY_PORT"
    local tmp="${MSRL_RAY_TMP:-/tmp}/ray_msrl_${SLURM_JOB_ID}"
    echo "ray_on_slurm: job $SLURM_JOB_ID, ${#MSRL_NODES[@]} nodes (${MSRL_NODES[*]}), head $head ($address)"
    echo "ray_on_slurm: each node: srun ${MSRL_SRUN_RESOURCES[*]}"
    local advertised="--num-gpus=$MSRL_NODE_GPUS"
    if ((MSRL_NODE_CPUS > 0)); then advertised="--num-cpus=$MSRL_NODE_CPUS $advertised"; fi
    echo "ray_on_slurm: each node: ray start $advertised (what the step got, measured on the node)"
    if [[ -n "${GLOO_SOCKET_IFNAME:-}${NCCL_SOCKET_IFNAME:-}" ]]; then
        echo "ray_on_slurm: sockets: GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-}"
    fi
    if [[ "${MSRL_DRY_RUN:-0}" == 1 ]]; then
        "$MSRL_PYTHON" -m megatron_sortedrl layout "$config" "$@"
        return 0
    fi
    # Ray's token authentication stays on: one random token per job, exported to every node through
    # srun's environment propagation and inherited by the driver.
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$("$MSRL_PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}
    export RAY_AUTH_TOKEN
    MSRL_RAY_PIDS=()
    MSRL_REQUEUE=0  # before the traps: a USR1 that arrives during bring-up must not be forgotten
    trap msrl_cleanup EXIT INT TERM
    trap msrl_forward_signal USR1

    # shellcheck disable=SC2046  # the argument list is word-split on purpose
    msrl_ray_node "$head" --head --node-ip-address="$head_ip" --port="$RAY_PORT" \
        --ray-client-server-port="$RAY_CLIENT_PORT" --include-dashboard=false --temp-dir="$tmp" \
        $(msrl_ray_start_args 0) &
    MSRL_RAY_PIDS+=($!)
    local i
    for ((i = 1; i < ${#MSRL_NODES[@]}; i++)); do
        # shellcheck disable=SC2046
        msrl_ray_node "${MSRL_NODES[$i]}" --address="$address" $(msrl_ray_start_args "$i") &
        MSRL_RAY_PIDS+=($!)
    done
    "$MSRL_PYTHON" -m megatron_sortedrl ray-check --address "$address" --expect-nodes "${#MSRL_NODES[@]}" \
        --timeout "$MSRL_JOIN_TIMEOUT" --node-names "${MSRL_NODES[@]}" || exit 2

    local status=0
    if [[ "$MSRL_REQUEUE" == 1 ]]; then  # the time limit is near before the run even started
        scontrol requeue "$SLURM_JOB_ID" || echo "ray_on_slurm: requeue failed; resubmit the script to resume" >&2
        return 0
    fi
    "$MSRL_PYTHON" -m megatron_sortedrl "$MSRL_SUBCOMMAND" "$config" "cluster.ray_address=$address" \
        "cluster.num_nodes=${#MSRL_NODES[@]}" "$@" &
    MSRL_DRIVER_PID=$!
    # `wait` returns early when a trapped signal arrives; keep waiting until the driver has exited.
    while true; do
        wait "$MSRL_DRIVER_PID" && status=0 || status=$?
        kill -0 "$MSRL_DRIVER_PID" 2>/dev/null || break
    done
    if [[ "$MSRL_REQUEUE" == 1 ]]; then
        scontrol requeue "$SLURM_JOB_ID" || echo "ray_on_slurm: requeue failed; resubmit the script to resume" >&2
    fi
    return "$status"
}
