"""One NVML sampler per GPU node of a Ray cluster, started and stopped by the driver.

    samplers = NodeSamplers.start(run_dir, clock.epoch, interval_s=0.1)   # after ray.init()
    ...                                                                  # the RL loop
    costs = samplers.stop()                                              # {host: sampler cost}

Each sampler is a zero-resource Ray actor pinned to its node, writing `<run_dir>/nvml/<host>.jsonl` on the
run clock passed in as `epoch`, so `run_dir` must be on a file system every node sees (as under Slurm).
Nodes are chosen from Ray's resource table (those offering "GPU"); a CPU-only cluster gets no samplers
and one line saying so.

Left out: restarting a sampler whose node died (its file simply stops), nodes that join after start.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_sortedrl.telemetry.nvml import NvmlSampler
from megatron_sortedrl.telemetry.timeline import RunClock

log = logging.getLogger(__name__)


def gpu_node_ids(nodes: list[dict]) -> list[str]:
    """Node ids of the live nodes that offer GPUs, from `ray.nodes()` records."""
    return [n["NodeID"] for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]


class SamplerActor:
    """Runs inside a Ray actor on one node (also usable directly, for a run without Ray)."""

    def __init__(self, run_dir: str, epoch: float, interval_s: float) -> None:
        self.host = socket.gethostname()
        self.sampler = NvmlSampler(Path(run_dir) / "nvml" / f"{self.host}.jsonl", clock=RunClock(epoch),
                                   interval_s=interval_s, host=self.host)
        self.ok = self.sampler.start()

    def status(self) -> tuple[str, bool, str | None]:
        return self.host, self.ok, self.sampler.unavailable_reason

    def stop(self) -> dict:
        return self.sampler.stop()


@dataclass
class NodeSamplers:
    actors: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, run_dir: str | os.PathLike, epoch: float, interval_s: float = 0.1) -> NodeSamplers:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_ids = gpu_node_ids(ray.nodes())
        if not node_ids:
            log.warning("NVML unavailable: the Ray cluster has no GPU nodes; continuing without GPU utilization sampling")
            return cls()
        remote = ray.remote(num_cpus=0, num_gpus=0)(SamplerActor)
        actors = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False))
                  .remote(str(run_dir), epoch, interval_s) for n in node_ids]
        for host, ok, reason in ray.get([a.status.remote() for a in actors]):
            if not ok:
                log.warning("NVML unavailable on %s: %s; continuing without GPU utilization sampling there", host, reason)
        return cls(actors)

    def stop(self) -> dict[str, dict]:
        """Stop every sampler; returns each node's sampler cost keyed by host."""
        if not self.actors:
            return {}
        import ray

        hosts = [h for h, _, _ in ray.get([a.status.remote() for a in self.actors])]
        costs = ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        return dict(zip(hosts, costs))
