#!/usr/bin/env bash
# One node's Ray, inside the srun step that slurm/ray_on_slurm.sh starts on it: `ray start` advertises what
# the step was given, not what the node has.
#
#   srun ... --cpus-per-task=N --mem=0 --exact slurm/ray_node.sh <python> <node name> <asked CPUs> <asked GPUs> \
#       <ray start arguments ...>
#
# - CPUs: the cores this process may run on (`nproc` follows the cpuset Slurm's task/cgroup plugin gives the
#   step). Ray itself counts every core of the machine, so a step confined to one core would still advertise
#   them all and Ray would place every trainer rank and engine of the node on that core.
# - GPUs: the entries of CUDA_VISIBLE_DEVICES when Slurm set it for the step's GPUs; else the count asked for.
# - Memory: the smallest limit of the step's cgroup and those above it (v2 memory.max or v1
#   memory.limit_in_bytes under MSRL_CGROUP_FS, default /sys/fs/cgroup), split as Ray splits a machine's
#   memory: 30% object store, the rest `--memory`. No limit: Ray's own defaults.
# - Object store: at most half of the shared-memory filesystem (MSRL_SHM_DIR, default /dev/shm). Ray refuses
#   an explicit object store larger than /dev/shm, which is small on containerised nodes, and vLLM, NCCL and
#   the weight-sync ring (rollout/weight_sync.py) use the same filesystem; what the cap takes from the object
#   store goes to `--memory`.
# The ray start arguments given come after these, so MSRL_RAY_START_ARGS still wins. A step that got less than
# it asked for is named in one line (a site whose srun ignores the request) and Ray advertises what it got.
# Left out: heterogeneous nodes are fine here (each node measures itself), but the batch host still asks
# every node for its own counts (ray_on_slurm.sh).
set -euo pipefail

python=$1 node=$2 asked_cpus=$3 asked_gpus=$4
shift 4

# Without OMP_NUM_THREADS / OMP_THREAD_LIMIT: GNU nproc honours them, and a job that sets OMP_NUM_THREADS=1 (as
# many do for their ranks) would otherwise make Ray advertise one CPU.
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
gpus=$asked_gpus
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    if [[ -z "$CUDA_VISIBLE_DEVICES" ]]; then gpus=0; else gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | wc -l); fi
fi

step_memory_limit() {
    # Prints the smallest memory limit of this process's cgroup and its ancestors (Slurm limits the job and
    # the step; the task's own cgroup below them often has none), or nothing when there is none.
    local root=${MSRL_CGROUP_FS:-/sys/fs/cgroup} path dir name value limit=
    if [[ -f "$root/cgroup.controllers" ]]; then  # cgroup v2: one hierarchy, "0::/path"
        path=$(awk -F: '$1 == "0" {print $3; exit}' /proc/self/cgroup)
        dir=$root name=memory.max
    else  # cgroup v1: the memory controller's own hierarchy
        path=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3; exit}' /proc/self/cgroup)
        dir=$root/memory name=memory.limit_in_bytes
    fi
    while :; do
        if [[ -r "$dir$path/$name" ]]; then
            value=$(<"$dir$path/$name")
            # "max", or v1's "unlimited" (a page-rounded 2^63, 19 digits): no limit at this level
            if [[ "$value" =~ ^[0-9]+$ ]] && ((${#value} < 19)); then
                if [[ -z "$limit" ]] || ((value < limit)); then limit=$value; fi
            fi
        fi
        [[ -n "$path" && "$path" != / ]] || break
        path=${path%/*}
    done
    if [[ -n "$limit" ]]; then echo "$limit"; fi
}

shm_bytes() {
    # Size in bytes of the shared-memory filesystem Ray's object store lives in, or nothing without one.
    local dir=${MSRL_SHM_DIR:-/dev/shm}
    if [[ -d "$dir" ]]; then echo $(($(df -Pk "$dir" | awk 'NR == 2 {print $2}') * 1024)); fi
}

args=(--num-cpus="$cpus" --num-gpus="$gpus")
memory=$(step_memory_limit)
if [[ -n "$memory" ]]; then
    store=$((memory * 3 / 10))
    shm=$(shm_bytes)
    if [[ -n "$shm" ]] && ((store > shm / 2)); then
        echo "ray_on_slurm: $node: object store capped at half of ${MSRL_SHM_DIR:-/dev/shm} ($((shm / 2)) bytes)" \
            "instead of 30% of the step's memory ($store bytes)" >&2
        store=$((shm / 2))
    fi
    args+=(--memory="$((memory - store))" --object-store-memory="$store")
fi
if [[ "$asked_cpus" != 0 && "$cpus" -lt "$asked_cpus" ]] || ((gpus < asked_gpus)); then
    echo "ray_on_slurm: $node: the step got $cpus CPUs and $gpus GPUs of the $asked_cpus and $asked_gpus asked for;" \
        "Ray advertises what it got" >&2
fi
echo "ray_on_slurm: $node: ray start ${args[*]}"
exec "$python" -m ray.scripts.scripts start "${args[@]}" "$@"
