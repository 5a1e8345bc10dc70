"""The colocated plan: per-GPU memory in each phase when the trainer and the engines take turns on the same GPUs.

    python -m megatron_sortedrl plan configs/qwen7b_colocated_8gpu.yaml --model-config configs/model_shapes/qwen2.5-7b-instruct
    from megatron_sortedrl.plan.colocated import switch_seconds, trainer_state_bytes   # what the simulator uses

A colocated step (`cluster.colocate`) runs three phases on every GPU, and the plan checks each against the
GPU less `plan.margin`:

- **rollout**: the engine awake, with its whole vLLM budget (`rollout.gpu_memory_utilization` x GPU: weights,
  `plan.engine_reserve_gib`, KV cache), next to what the trainer leaves on the GPU: with
  `cluster.offload_trainer` its process residue only (`TRAINER_IDLE_GIB`), without it also its weights, fp32
  gradients and optimizer state. The KV cache the engines get is what the rollout phase leaves: the budget
  may not exceed the GPU less the margin less the trainer's part, and the plan prints the largest
  `rollout.gpu_memory_utilization` that fits;
- **update**: the trainer's whole plan for its stage (weights, gradients, optimizer, activations, logits,
  as `plan/trainer_memory.py` counts them) next to a sleeping engine's residue (`ENGINE_ASLEEP_GIB`: vLLM's sleep
  frees its weights and KV pools, not its CUDA context, graphs and NCCL buffers); `cluster.engine_sleep_level`
  1 keeps the engine's weights in host memory, 2 frees them (both leave the GPU);
- **switch** (the weight handoff, the peak of the transition): the trainer's weights (and, without offload,
  its gradients and optimizer state), the engine's freshly woken weights and two handoff buckets live at
  once, plus both
  processes' residues. Activations and KV cache are not alive then. A bucket is max(256 MiB, the largest HF
  tensor), as in the weight sync.

Host memory per node adds the offloaded trainer state (weights, gradients and optimizer of every trainer rank
on the node, pinned) and, at sleep level 1, every engine rank's weights.

Switch costs per step, in seconds (`switch_seconds`, the same function the simulator charges,
`scheduler/sim/layout_sim.py`):

    sleep   = engine weights per GPU / offload_gbs        (level 1; level 2 frees them: 0)
    reload  = trainer state per GPU / offload_gbs         (offload_trainer; else 0)
    offload = trainer state per GPU / offload_gbs         (offload_trainer; else 0)
    wake    = ENGINE_WAKE_S + (level 1: engine weights per GPU / offload_gbs)
    handoff = model bytes / handoff_gbs                   (every engine GPU reads the whole model's HF tensors
                                                           over CUDA IPC and keeps its shard, as in the NCCL sync)

`plan.offload_gbs` (0: 25 GB/s, host-device copies from pinned memory when all GPUs of a node copy at once over
PCIe Gen4/5 x16; 5 GB/s on CPU, a memcpy) and `plan.handoff_gbs` (0: 100 GB/s, device-to-device over CUDA IPC
with the trainer's TP gather over NVLink; on CPU the object-store sync's `plan.sync_bandwidth_gbs`).
`ENGINE_WAKE_S` is re-creating the KV cache and the engine's memory pools.

Left out (a GPU measurement confirms or corrects them, docs/scaling.md): the residues and the wake constant
are assumptions, allocator fragmentation after many sleep/wake cycles is the margin's, and copies that overlap
(offloading the optimizer while the engine wakes) are charged one after the other.
"""

from __future__ import annotations

from megatron_sortedrl.plan.engine import BUCKET_BYTES, BUCKETS_IN_FLIGHT, DTYPE_BYTES, GIB, sync_bandwidth_gbs

TRAINER_IDLE_GIB = 1.0  # an offloaded trainer rank's GPU residue: CUDA context, NCCL communicators, allocator cache
ENGINE_ASLEEP_GIB = 1.0  # a sleeping engine rank's GPU residue: CUDA context, CUDA graphs, NCCL buffers
ENGINE_WAKE_S = 1.0  # seconds to wake an engine beyond copying weights: KV cache and memory pools re-created
OFFLOAD_GBS = {"gpu": 25.0, "cpu": 5.0}  # plan.offload_gbs = 0
HANDOFF_GBS_GPU = 100.0  # plan.handoff_gbs = 0 on GPU (CPU: the object-store sync's bandwidth)
STATE_ITEMS = ("weights", "gradients", "optimizer")  # what the trainer offloads


def trainer_state_bytes(params: float, dtype_bytes: int, model_parallel: int, gpus: int) -> float:
    """The trainer's offloadable state on one GPU, from the model size alone (the simulator's form): weights in
    the model dtype and fp32 gradients over TP x PP, Adam's fp32 master copy and moments (12 B) over every GPU
    (distributed optimizer). The planner uses its per-stage items instead; they agree within a few percent."""
    return params * (dtype_bytes + 4) / model_parallel + params * 12 / gpus


def switch_seconds(*, trainer_state: float, engine_weights: float, model_bytes: float, sleep_level: int,
                   offload_trainer: bool, offload_gbs: float, handoff_gbs: float,
                   wake_s: float = ENGINE_WAKE_S) -> dict[str, float]:
    """Seconds of each transition of one colocated step (bytes are per GPU except `model_bytes`; GB/s are 1e9)."""
    pcie = offload_gbs * 1e9
    moved = trainer_state / pcie if offload_trainer else 0.0
    weights = engine_weights / pcie if sleep_level == 1 else 0.0
    out = {"sleep": weights, "reload": moved, "offload": moved, "wake": wake_s + weights,
           "handoff": model_bytes / (handoff_gbs * 1e9)}
    out["total"] = sum(out.values())
    return out


def bandwidths(cfg, device: str) -> tuple[float, float]:
    """(offload GB/s, handoff GB/s) of the config, defaults filled."""
    offload = cfg.plan.offload_gbs or OFFLOAD_GBS[device]
    handoff = cfg.plan.handoff_gbs or (HANDOFF_GBS_GPU if device == "gpu" else sync_bandwidth_gbs(cfg, device))
    return offload, handoff


def colocated_phases(cfg, arch, device: str, trainer: list[dict], engines: dict) -> dict:
    """Per pipeline stage, the bytes on one GPU in each phase (rollout, switch, update), the switch costs and the
    bytes a node's host memory takes; `engines` is the planner's engine memory by round kind."""
    c = cfg.cluster
    offload = c.offload_trainer
    dtype = DTYPE_BYTES[cfg.model.dtype]
    # The layout with the most weights per rank (the smallest engine TP) is the one that must fit.
    eng = max(engines.values(), key=lambda e: e["weights"])
    buckets = BUCKETS_IN_FLIGHT * max(BUCKET_BYTES, max(arch.embedding_params, arch.output_params) * dtype)
    idle, asleep = TRAINER_IDLE_GIB * GIB, ENGINE_ASLEEP_GIB * GIB
    stages = []
    for st in trainer:
        state = sum(st["items"].get(k, 0.0) for k in STATE_ITEMS)
        resident = 0.0 if offload else state
        rollout = {"trainer state (resident)": resident, "trainer residue": idle,
                   "engine weights": eng["weights"], "engine reserve": eng["reserve"], "KV cache": eng["kv_bytes"]}
        switch = {"trainer weights": st["items"]["weights"],
                  "trainer gradients + optimizer (resident)": 0.0 if offload else state - st["items"]["weights"],
                  "trainer residue": idle, "engine weights": eng["weights"], "handoff buckets": float(buckets),
                  "engine residue (asleep)": asleep}
        update = {"trainer (its plan)": st["total"], "engine residue (asleep)": asleep}
        usable = c.gpu_memory_gib * GIB * (1 - cfg.plan.margin)
        # The largest vLLM budget the rollout phase leaves: usable GPU less what the trainer keeps there.
        room = usable - resident - idle
        stages.append({"stage": st["stage"], "state": state,
                       "phases": {"rollout": rollout, "switch": switch, "update": update},
                       "totals": {"rollout": sum(rollout.values()), "switch": sum(switch.values()),
                                  "update": sum(update.values())},
                       "engine_budget": eng["budget"], "engine_room": room,
                       "max_gpu_memory_utilization": max(0.0, room / (c.gpu_memory_gib * GIB))})
    offload_gbs, handoff_gbs = bandwidths(cfg, device)
    worst = max(stages, key=lambda s: s["state"])
    costs = switch_seconds(trainer_state=worst["state"], engine_weights=eng["weights"],
                           model_bytes=arch.num_params * dtype, sleep_level=c.engine_sleep_level,
                           offload_trainer=offload, offload_gbs=offload_gbs, handoff_gbs=handoff_gbs)
    return {"stages": stages, "switch_s": costs, "offload_gbs": offload_gbs, "handoff_gbs": handoff_gbs,
            "sleep_level": c.engine_sleep_level, "offload_trainer": offload, "engine_tp": eng["tp"],
            "engine_weights": eng["weights"], "handoff_bytes": arch.num_params * dtype, "buckets": float(buckets)}


def colocated_host_nodes(cfg, col: dict, proc: float, driver: dict) -> list[dict]:
    """Host memory per node of a colocated GPU run: every GPU holds one trainer rank and one engine rank (in GPU
    order, so each node holds its GPUs' offloaded state)."""
    c, p = cfg.cluster, cfg.parallel
    per_node = c.gpus_per_node or p.world_size
    gpus = p.world_size
    ranks_per_stage = p.tensor_model_parallel_size * p.data_parallel_size
    nodes = []
    for node in range(max(1, -(-gpus // per_node))):
        here = range(node * per_node, min(gpus, (node + 1) * per_node))
        items = dict(driver) if node == 0 else {"Ray (raylet; GCS on node 0)": proc}
        items["trainer ranks"] = len(here) * proc
        # Engine processes: one actor per engine plus one worker per engine rank (short-round layout).
        items["engine processes"] = len(here) * proc * (1 + 1 / col["engine_tp"])
        if col["offload_trainer"]:
            items["offloaded trainer state (pinned)"] = sum(
                col["stages"][g // ranks_per_stage]["state"] for g in here)
        if col["sleep_level"] == 1:
            items["sleeping engine weights (level 1)"] = len(here) * col["engine_weights"]
        nodes.append({"node": node, "items": items, "total": sum(items.values())})
    return nodes


def colocated_checks(cfg, col: dict, check_cls) -> list:
    """One check per phase and stage against the GPU less the margin, plus the engines' vLLM budget against what
    the rollout phase leaves (vLLM refuses to start when its budget is not free)."""
    c = cfg.cluster
    gpu = c.gpu_memory_gib * GIB
    usable = gpu * (1 - cfg.plan.margin)
    checks = []
    for st in col["stages"]:
        s = st["stage"]
        t = st["totals"]
        checks.append(check_cls(
            f"colocated rollout phase, stage {s} per GPU (vLLM budget)", st["engine_budget"], gpu, st["engine_room"],
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization}, trainer "
            + ("offloaded" if c.offload_trainer else f"state {st['state'] / GIB:.1f} GiB resident"),
            f"set rollout.gpu_memory_utilization <= {st['max_gpu_memory_utilization']:.2f}"
            + ("" if c.offload_trainer else " or cluster.offload_trainer=true")))
        checks.append(check_cls(
            f"colocated switch peak, stage {s} per GPU", t["switch"], gpu, usable,
            f"trainer weights {st['phases']['switch']['trainer weights'] / GIB:.1f} GiB + engine weights "
            f"{st['phases']['switch']['engine weights'] / GIB:.1f} GiB + handoff buckets",
            "set cluster.offload_trainer=true, raise rollout.tensor_parallel_size or the trainer's TP/PP"))
        checks.append(check_cls(
            f"colocated update phase, stage {s} per GPU", t["update"], gpu, usable,
            f"trainer {st['phases']['update']['trainer (its plan)'] / GIB:.1f} GiB + a sleeping engine",
            "lower trainer.micro_batch_tokens, set parallel.recompute.granularity=full or raise the trainer's TP/PP"))
    return checks
