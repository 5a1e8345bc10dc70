"""Colocated placement: trainer ranks and rollout engines in the same placement-group bundles, sharing devices.

    bundles = colocated_bundles(cfg, gpu=True)             # one bundle per block of `block_size(cfg)` devices
    shared = SharedPlacement(reservation, block, gpu_ids)  # built by TrainerGroup; the pool starts engines in it
    resources, env = shared.engine_options(engine, tp, resources, env)

A block is lcm(trainer TP, rollout TP, long-round TP) devices, so every TP group of the trainer and of both
engine layouts lies inside one bundle, and a bundle never spans nodes (Ray does not split bundles; pinned to
the layout's node when `cluster.gpus_per_node` is declared, as in `megatron_sortedrl.placement`). Trainer rank
r sits in block r // B; engine e (TP t) uses the devices of trainer ranks e*t .. e*t+t-1, in block e*t // B.

Fractional GPUs: a trainer rank asks for 0.6 of a GPU, so no two ranks can be packed onto one GPU of their
bundle and each gets its own; an engine asks for 0.4 (what is left of one GPU) for Ray's bookkeeping, and its
vLLM workers see exactly its trainer ranks' GPUs through CUDA_VISIBLE_DEVICES (set explicitly, with Ray told
not to overwrite it), since Ray cannot give one actor fractions of several GPUs; on one node the engine also
sees the node's other trainer GPUs after its own, so it can open the stage senders' CUDA IPC handles (the
weight hand-off, `weight_sync_gpu.ipc_send_stage`). On CPU the bundles carry the
trainer ranks' and the engines' CPUs (one per rank each, as disaggregated), so the same code runs.

Checked on a GPU machine only (tests/test_colocate_gpu.py); the CPU path is exercised by every colocated run.
Left out: engines on more devices than the trainer has (rollout GPUs must not exceed the trainer's world).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.layout import layout_node
from megatron_sortedrl.placement import Bundle

TRAINER_GPU_SHARE = 0.6  # > 1/2: two trainer ranks never fit on one GPU
ENGINE_GPU_SHARE = 0.4  # the rest of one GPU


def block_size(cfg: Any) -> int:
    r = cfg.rollout
    return math.lcm(cfg.parallel.tensor_model_parallel_size, r.tensor_parallel_size, r.long_round_tensor_parallel_size)


def check_colocated(cfg: Any) -> None:
    """ConfigError when the engines cannot share the trainer's devices block by block; it names the key that is
    wrong (an engine TP, the engine count, the node size) and the values that would work."""
    r, world = cfg.rollout, cfg.parallel.world_size
    fits = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    for key in ("tensor_parallel_size", "long_round_tensor_parallel_size"):
        tp = getattr(r, key)
        if world % tp:  # an engine's TP group must be whole trainer ranks of one block (also: TP > the world)
            raise ConfigError(f"rollout.{key}", tp, f"one of {fits} with cluster.colocate=true (a divisor of the "
                              f"trainer's devices, TP x PP x DP = {world}: the engines run on them), or "
                              "cluster.colocate=false")
    rollout = r.num_workers * r.tensor_parallel_size
    if rollout > world:
        raise ConfigError("rollout.num_workers", r.num_workers,
                          f"at most {world // r.tensor_parallel_size} with cluster.colocate=true (engines x TP = "
                          f"{rollout} devices, the trainer has {world})")
    block = block_size(cfg)  # every TP divides the world, so their lcm does too
    gpn = cfg.cluster.gpus_per_node
    if gpn and gpn % block:
        raise ConfigError("cluster.gpus_per_node", gpn, f"a multiple of {block} (lcm of the trainer and rollout TPs) "
                          "with cluster.colocate=true, so a block of shared devices never spans nodes")


def colocated_bundles(cfg: Any, *, gpu: bool, cpus_per_rank: float = 1.0) -> list[Bundle]:
    """One bundle per block of devices, holding its trainer ranks and the engines on them."""
    check_colocated(cfg)
    block, world, gpn = block_size(cfg), cfg.parallel.world_size, cfg.cluster.gpus_per_node
    out = []
    for b in range(world // block):
        first = b * block
        res = {"CPU": 2 * cpus_per_rank * block, **({"GPU": float(block)} if gpu else {})}
        node = layout_node(first, gpn) if gpu and gpn else None
        out.append(Bundle(res, f"colocated block {b} (trainer ranks and engine devices {first}-{first + block - 1})",
                          node))
    return out


@dataclass
class SharedPlacement:
    """The trainer's reservation, lent to the rollout pool (`PoolOptions.shared_placement`)."""

    reservation: Any  # placement.Reservation of `colocated_bundles`
    block: int
    gpu_ids: list[list[str]]  # per trainer rank: the GPU ids Ray gave it (empty on CPU)

    @property
    def one_node(self) -> bool:
        """Every bundle on one node: each engine can see every stage sender's GPU (CUDA IPC hand-off)."""
        return len(set(self.reservation.bundle_nodes)) == 1 and any(self.gpu_ids)

    def bundle_of(self, engine: int, tp: int) -> int:
        return engine * tp // self.block

    def engine_options(self, engine: int, tp: int, resources: dict, env: dict) -> tuple[dict, dict]:
        """Ray resources and environment of engine `engine` (TP `tp`) on its trainer ranks' devices."""
        ranks = range(engine * tp, (engine + 1) * tp)
        if "num_gpus" in resources:
            devices = [i for r in ranks for i in self.gpu_ids[r]]
            if self.one_node:  # the others after its own (vLLM's ranks take the first ones), for CUDA IPC
                devices += [i for ids in self.gpu_ids for i in ids if i not in devices]
            env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(devices), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
            resources = {**resources, "num_gpus": ENGINE_GPU_SHARE}
        return resources, env
