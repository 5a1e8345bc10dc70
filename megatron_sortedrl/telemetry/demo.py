"""A synthetic run directory (timeline + NVML samples) for trying the report without a GPU.

    python -m megatron_sortedrl.telemetry.demo runs/demo_telemetry
    python -m megatron_sortedrl nvml-report runs/demo_telemetry --max-batch 8

It imitates a colocated synchronous RL step on one 8-GPU node: 4 rollout workers (TP=2, 8 slots each)
decode requests whose lengths have a long tail, so workers run out of work at different times (the
rollout bubble); then reward (CPU only), log-prob, train and weight sync. GPU utilization is ~95 % while
a worker has a sequence in flight and ~0 % otherwise. The numbers are made up: the run shows what the
figures look like, not how fast anything is. docs/images/nvml_report.png is rendered from it.

Left out: the length-aware scheduler itself (this is the baseline it is meant to improve on).
"""

from __future__ import annotations

import heapq
import json
import random
import sys
from pathlib import Path

from megatron_sortedrl.telemetry.timeline import Event, TimelineWriter

WORKERS, TP, SLOTS = 4, 2, 8
TOKENS_PER_S = 40.0  # per sequence
PHASE_UTIL = {"reward": 1, "logprob": 85, "train": 93, "sync": 35}
PHASE_SECONDS = {"reward": 3.0, "logprob": 6.0, "train": 14.0, "sync": 2.0}


def _decode(worker: int, lengths: list[int], t0: float) -> list[tuple[float, float, int]]:
    """(start, end, tokens) per request on one worker with SLOTS continuous-batching slots."""
    free = [t0] * SLOTS
    out = []
    for n in lengths:
        start = heapq.heappop(free)
        end = start + n / TOKENS_PER_S
        heapq.heappush(free, end)
        out.append((start, end, n))
    return out


def write_demo(run_dir: str | Path, steps: int = 4, prompts_per_worker: int = 24, seed: int = 0,
               interval_s: float = 0.1) -> Path:
    rng = random.Random(seed)
    run = Path(run_dir)
    (run / "nvml").mkdir(parents=True, exist_ok=True)
    busy: dict[int, list[tuple[float, float, float]]] = {g: [] for g in range(WORKERS * TP)}  # (a, b, util)
    t = 0.0
    with TimelineWriter(run / "timeline.jsonl") as tl:
        for step in range(steps):
            tl.write(Event(t, "phase", "start", step, phase="rollout"))
            ends = []
            for w in range(WORKERS):
                lengths = [int(min(4000, rng.lognormvariate(6.2, 0.7))) for _ in range(prompts_per_worker)]
                reqs = _decode(w, lengths, t)
                for i, (a, b, n) in enumerate(reqs):
                    sid = f"s{step}-w{w}-{i}"
                    tl.write(Event(a, "request", "submit", step, worker=w, sample_id=sid))
                    tl.write(Event(b, "request", "finish", step, worker=w, sample_id=sid, tokens=n))
                last = max(b for _, b, _ in reqs)
                tl.write(Event(t, "worker", "busy", step, worker=w))
                tl.write(Event(last, "worker", "idle", step, worker=w))
                for g in range(w * TP, (w + 1) * TP):
                    busy[g].append((t, last, 95))
                ends.append(last)
            t = max(ends) + 0.2
            tl.write(Event(t, "phase", "end", step, phase="rollout"))
            for name in ("reward", "logprob", "train", "sync"):
                dur = PHASE_SECONDS[name] * rng.uniform(0.9, 1.1)
                tl.write(Event(t, "phase", "start", step, phase=name))
                for g in busy:
                    busy[g].append((t, t + dur, PHASE_UTIL[name]))
                t += dur
                tl.write(Event(t, "phase", "end", step, phase=name))
            t += 0.5  # driver bookkeeping between steps: shows as "idle"
    with open(run / "nvml" / "node0.jsonl", "w") as f:
        gpus = [{"index": g, "name": "NVIDIA H100 80GB HBM3 (synthetic)", "uuid": f"GPU-demo-{g}",
                 "mem_total_mib": 81559.0, "power_limit_w": 700.0} for g in busy]
        f.write(json.dumps({"meta": {"host": "node0", "epoch": 0.0, "interval_s": interval_s,
                                     "driver": "synthetic", "gpus": gpus}}) + "\n")
        for k in range(int(t / interval_s)):
            ts = round(k * interval_s, 3)
            for g, spans in busy.items():
                u = next((u for a, b, u in spans if a <= ts < b), 0)
                u = max(0, min(100, round(u + rng.gauss(0, 3)))) if u else 0
                f.write(json.dumps({"t": ts, "host": "node0", "gpu": g, "util": u, "mem_used_mib": 62000.0,
                                    "power_w": round(90 + 5.5 * u, 1), "sm_clock_mhz": 1980 if u else 345,
                                    "temp_c": 35 + u // 3}, separators=(",", ":")) + "\n")
    return run


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m megatron_sortedrl.telemetry.demo <out_dir>")
    print(f"wrote {write_demo(sys.argv[1])}")
