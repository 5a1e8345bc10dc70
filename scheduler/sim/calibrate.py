"""Calibrates the simulator from a real run directory: engine and cluster costs measured from the run's
timeline and metrics, and the run's own response lengths to replay.

    python -m megatron_sortedrl simulate configs/sim_tiny_cpu.yaml --calibrate-from runs/tiny_cpu --policies sync
    from scheduler.sim.calibrate import calibrate_run, apply_calibration
    cal = calibrate_run("runs/tiny_cpu"); sim = apply_calibration(sim, cal, "runs/sim/lengths.json")

What is measured, and how (every figure is also in `Calibration.fit` for the report):

- Decode step time `s(B, C) = k_w * (a + b * B + c * C)` of engine w (B running sequences, C their total context
  in tokens, k_w the engine's slowdown against engine 0: engines on unevenly shared cores differ), the
  prefill cost per prompt token `pi` and the delivery delay `delta` (engine finish -> the driver's finish
  event). All requests of one engine advance one token per decode step, so the engine has
  a single step counter S(t). Between two request events on a worker B is fixed and C grows by B per step,
  so the steps taken in `dt` seconds solve `dt = (a + b B + c C0) dS + c B dS^2 / 2` in closed form; a
  request admitted at `f` (its `first_token` event) first costs the engine `pi * prompt_tokens` seconds of
  prefill. Each request that produced `n` tokens after its first gives one equation `S(end) - S(f) = n`.
  The parameters are the least-squares solution (Levenberg-Marquardt on numpy, written in `decode_fit.py`
  because scipy is not a dependency; about 20 lines). On a simulated timeline this model is the simulator's own,
  so the fit recovers its costs (tests/test_calibrate.py); on a real one it is the roofline the simulator
  uses, and `fit["decode_rel_rms"]` says how well it explains the run.
- Engine jitter: per round and engine, how much slower than the fit the engine ran (predicted decode steps
  / tokens made); the standard deviation of its log around each engine's mean is `cluster.engine_jitter`,
  which the simulator draws per round (engines on shared cores change speed from round to round, and the
  slower engine of a round sets the worker bubble).
- Training: seconds of each step's `train` phase against the tokens (prompt + response) of the samples
  it trained (`reward/per_sample` in metrics.jsonl names them): least squares `fixed + tokens / rate`.
- Weight sync: the mean per step of everything that is neither rollout nor training (sync, history
  shipping, driver gaps between phases): the simulator pays it once per update as `weight_sync_s`.
- Round start: the median per step of the first token's delay after the rollout phase starts, less that
  admission's prefill (composition, placement, submission round trip): `cluster.round_start_s`.
- Reward latency: the median per step of rollout end minus the last finish before it (scoring, harvest
  and aborts), plus `delta`.
- Replay: each sample's final response length, by prompt, epoch and sample index (`lengths.json`), so the
  simulated sample `p/e1/3` generates as many tokens as the real one did.

Prompt lengths come from re-encoding the run's prompts with its config and tokenizer (the timeline does not
record them); when that is impossible (model directory gone) the scenario's `workload.prompt_tokens` is used.

Left out: speculative decoding (calibrate from runs with `speculative.enabled=false`), KV-cache pressure
(the capacity is taken from `rollout.kv_cache_gib`, not measured), relayout cost (the real driver runs a
fixed layout), and per-prompt prompt lengths in the replay (their mean is used).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from megatron_sortedrl.errors import UserError
from megatron_sortedrl.telemetry.timeline import Event, read_run_timeline, step_breakdown
from scheduler.sim.decode_fit import RequestSpan, SAMPLE_ID, engine_jitter, fit_decode, prompt_of_sample, request_spans

GIB = 1024**3


@dataclass
class Calibration:
    """Measured costs; `engine` and `cluster` hold fields of `EngineCostModel` and `ClusterCosts`."""

    engine: dict[str, float] = field(default_factory=dict)
    cluster: dict[str, float] = field(default_factory=dict)
    lengths: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # replay table
    prompt_tokens: float = 0.0  # mean prompt length used (0: unknown)
    fit: dict[str, Any] = field(default_factory=dict)  # step model, residuals, counts


# ------------------------------------------------------------------------------------------ the run


def replay_table(events: Sequence[Event]) -> dict[str, dict[int, list[int]]]:
    """{prompt: {epoch: [final response length by sample index]}} from the finish events (last one wins)."""
    final: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for e in events:
        if e.kind == "request" and e.event == "finish" and e.sample_id and e.tokens is not None:
            m = SAMPLE_ID.fullmatch(e.sample_id)
            if m:
                final[(m.group(1), int(m.group(2)))][int(m.group(3))] = int(e.tokens)
    table: dict[str, dict[int, list[int]]] = defaultdict(dict)
    for (pid, epoch), per in final.items():
        fill = int(statistics.median(per.values()))  # a sample the run never finished: its prompt's median
        table[pid][epoch] = [per.get(i, fill) for i in range(max(per) + 1)]
    return dict(table)


def run_prompt_tokens(run_dir: Path) -> dict[str, int]:
    """Prompt token counts of the run's training prompts, re-encoded as the driver did ({} if impossible)."""
    try:
        from transformers import AutoTokenizer

        from megatron_sortedrl.config import load_config
        from megatron_sortedrl.data import load_prompts
        from megatron_sortedrl.data.prompting import PromptEncoder

        cfg = load_config(run_dir / "config.yaml", [])
        tok = AutoTokenizer.from_pretrained(cfg.model.path)
        enc = PromptEncoder(tok, cfg.data)
        return {p.prompt_id: len(enc.encode(p)) for p in load_prompts(cfg.data, "train")}
    except Exception:  # the model directory or data moved: the caller falls back to a mean
        return {}


def _metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_MEMO: dict[tuple, Calibration] = {}


def calibrate_run(run_dir: str | Path, default_prompt_tokens: float = 64.0, prompt_tokens: dict[str, int] | None = None,
                  init: Sequence[float] = (0.004, 0.0002, 1e-7, 5e-5, 0.005)) -> Calibration:
    """Measures a run directory (timeline*.jsonl + metrics.jsonl + config.yaml); see the module docstring.
    `prompt_tokens` ({prompt id: tokens}) overrides re-encoding the run's prompts. A finished run measured
    again with the same arguments is answered from memory (the decode fit takes seconds)."""
    run_dir = Path(run_dir)
    stamp = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.glob("timeline*.jsonl")))
    key = (str(run_dir.resolve()), stamp, default_prompt_tokens, json.dumps(prompt_tokens, sort_keys=True), tuple(init))
    if stamp and key in _MEMO:
        return _MEMO[key]
    _MEMO[key] = cal = _calibrate_run(run_dir, default_prompt_tokens, prompt_tokens, init)
    return cal


def _calibrate_run(run_dir: Path, default_prompt_tokens: float, prompt_tokens: dict[str, int] | None,
                   init: Sequence[float]) -> Calibration:
    if not any(run_dir.glob("timeline*.jsonl")):
        raise UserError(f"--calibrate-from {run_dir}: no timeline*.jsonl there; give the run directory of a "
                        "`train` run (logging.run_dir)")
    events = read_run_timeline(run_dir)
    prompts = prompt_tokens if prompt_tokens is not None else run_prompt_tokens(run_dir)
    mean_prompt = statistics.mean(prompts.values()) if prompts else float(default_prompt_tokens)
    reqs = request_spans(events, prompts or {}, mean_prompt)
    theta, fit = fit_decode(reqs, init)
    a, b, c, pi, delta = (float(x) for x in theta[:5])
    by_worker = dict(zip(sorted({r.worker for r in reqs}), [1.0, *(float(x) for x in theta[5:])]))
    jitter = engine_jitter(reqs, theta)
    slowdown = [by_worker.get(w, 1.0) for w in range(max(by_worker) + 1)]  # indexed by engine

    # Per step: phase seconds (train, everything else), and the harvest latency.
    rows = {r["step"]: r for r in _metrics_rows(run_dir) if "reward/per_sample" in r}
    lengths = {e.sample_id: e.tokens for e in events if e.kind == "request" and e.event == "finish" and e.sample_id}
    breakdown = step_breakdown(events)
    train_x, train_y, other, latency = [], [], [], []
    finishes: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e.kind == "request" and e.event == "finish":
            finishes[e.step].append(e.t)
    ends = {e.step: e.t for e in events if e.kind == "phase" and e.phase == "rollout" and e.event == "end"}
    aborted = {e.step for e in events if e.kind == "request" and e.event == "abort"}
    for step, row in breakdown.items():
        if "rollout" not in row or "train" not in row:
            continue
        total = sum(v for k, v in row.items())
        other.append(total - row["rollout"] - row["train"] - row.get("eval", 0.0) - row.get("checkpoint", 0.0))
        if step in rows:
            ids = list(rows[step]["reward/per_sample"])
            tokens = sum(prompts.get(prompt_of_sample(s), mean_prompt) + (lengths.get(s) or 0) for s in ids)
            train_x.append(tokens)
            train_y.append(row["train"])
        before = [t for t in finishes.get(step, []) if t <= ends.get(step, -1.0)]
        if before:
            latency.append((ends[step] - max(before), step not in aborted))
    starts = _round_start(events, reqs, pi, by_worker)
    if not other:
        raise UserError(f"--calibrate-from {run_dir}: the timeline has no step with both a rollout and a train phase")
    fixed, rate = _fit_train(train_x, train_y)

    table = replay_table(events)
    workers = {r.worker for r in reqs}
    cal = Calibration(lengths=table, prompt_tokens=mean_prompt)
    cal.engine = {"step_overhead_s": a, "per_seq_s": b, "kv_s_per_token": c, "prefill_tokens_per_s": 1.0 / pi if pi > 0 else 1e9}
    cal.cluster = {"train_fixed_s": fixed, "train_tokens_per_s": rate, "weight_sync_s": statistics.mean(other),
                   "reward_latency_s": _harvest_latency(latency) + delta,
                   "round_start_s": starts, "gpus": max(1, len(workers)),
                   "engine_slowdown": slowdown if len(slowdown) > 1 else [], "engine_jitter": jitter}
    cal.fit = {**fit, "a_s": a, "b_s": b, "c_s": c, "prefill_s_per_token": pi, "delivery_delay_s": delta,
               "train_points": len(train_x), "steps": len(other), "prompts": len(table),
               "epochs": 1 + max((e for per in table.values() for e in per), default=0),
               "prompt_tokens_source": "re-encoded" if prompts else "workload.prompt_tokens",
               "probe_s": probe_seconds(events)}
    return cal


def scale_to_probe(cal: Calibration, probe_s: float | None, gpus: int) -> Calibration:
    """`cal` (costs measured on another run) with every engine slowed by probe_s / cal's own probe: the
    engine speed of the machine at the time of the run to predict, from its identical pre-RL evaluation.
    Unchanged when either run has no probe."""
    own = cal.fit.get("probe_s")
    if not own or not probe_s:
        return cal
    out = _slowed(cal, probe_s / own, gpus)
    return replace(out, fit={**out.fit, "probe_scale": probe_s / own})


def probe_seconds(events: Sequence[Event]) -> float | None:
    """Seconds of the run's first evaluation (the pre-RL greedy eval at step 0), or None without one.

    Runs that start from the same weights and evaluate the same held-out prompts greedily do identical
    engine work there, whatever their policy; the ratio of two runs' probes is how much faster or slower
    the machine ran their engines (a CPU shared with other jobs drifts 2-3x between runs)."""
    start = [e.t for e in events if e.kind == "phase" and e.phase == "eval" and e.event == "start" and e.step == 0]
    end = [e.t for e in events if e.kind == "phase" and e.phase == "eval" and e.event == "end" and e.step == 0]
    return (min(end) - min(start)) if start and end and min(end) > min(start) else None


def _round_start(events: Sequence[Event], reqs: list[RequestSpan], pi: float, slow: dict[int, float]) -> float:
    """Median over steps of the mean over engines of (first first-token - rollout start - that admission's
    prefill): the time a round's requests take to reach the engines."""
    t0 = {e.step: e.t for e in events if e.kind == "phase" and e.phase == "rollout" and e.event == "start"}
    first: dict[tuple[int, int], list[RequestSpan]] = defaultdict(list)
    for r in reqs:
        first[(r.step, r.worker)].append(r)
    per_step: dict[int, list[float]] = defaultdict(list)
    for (step, worker), rs in first.items():
        if step not in t0:
            continue
        f = min(r.f for r in rs)
        per_step[step].append(f - t0[step] - slow[worker] * pi * sum(r.context0 for r in rs if r.f == f))
    vals = [statistics.mean(v) for v in per_step.values()]
    return max(0.0, float(statistics.median(vals))) if vals else 0.0


def _harvest_latency(per_step: list[tuple[float, bool]]) -> float:
    """Seconds from the sample that completes a harvest finishing to the rollout's end. In a step that aborted
    nothing the last finish is that sample (median over such steps); otherwise later finishes may land while
    its reward is scored, so the gap to the last finish underestimates it (90th percentile over steps)."""
    whole = [x for x, clean in per_step if clean]
    if whole:
        return float(statistics.median(whole))
    return float(np.percentile([x for x, _ in per_step], 90)) if per_step else 0.0


def _fit_train(x: list[float], y: list[float]) -> tuple[float, float]:
    """`y = fixed + x / rate` by least squares; a flat or falling line becomes all fixed cost."""
    if len(x) >= 3 and np.var(x) > 0:
        slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
        if slope > 0 and intercept >= 0:
            return float(intercept), float(1.0 / slope)
    return (float(np.mean(y)) if y else 0.0), 1e12


def apply_calibration(sim: Any, cal: Calibration, lengths_path: str | Path, tp: int = 1,
                      kv_cache_gib: float | None = None) -> Any:
    """A copy of `SimConfig` `sim` with the measured costs and the replay workload (written to `lengths_path`)."""
    from scheduler.sim.sim_config import WorkloadConfig

    Path(lengths_path).parent.mkdir(parents=True, exist_ok=True)
    Path(lengths_path).write_text(json.dumps({p: {str(e): v for e, v in per.items()} for p, per in cal.lengths.items()}))
    e = cal.engine
    kv = sim.engine.kv_bytes_per_token
    # The fitted step model is per engine at the run's TP; the roofline's weight read is folded into the
    # overhead (weight_gib = 0) and the context term sets the bandwidth.
    hbm = kv / (e["kv_s_per_token"] * tp * 1e9) if e["kv_s_per_token"] > 0 else 1e9
    engine = replace(sim.engine, weight_gib=0.0, expert_weight_gib=0.0, hbm_gbs=hbm,
                     tp_comm_s=0.0 if tp == 1 else sim.engine.tp_comm_s,
                     step_overhead_s=max(0.0, e["step_overhead_s"] - (sim.engine.tp_comm_s * math.log2(tp) if tp > 1 else 0.0)),
                     per_seq_s=e["per_seq_s"] * tp, prefill_tokens_per_s=e["prefill_tokens_per_s"] / tp,
                     gpu_mem_gib=kv_cache_gib if kv_cache_gib else sim.engine.gpu_mem_gib,
                     mem_utilization=1.0 if kv_cache_gib else sim.engine.mem_utilization)
    c = cal.cluster
    gpus = int(c["gpus"]) * tp
    cluster = replace(sim.cluster, gpus=gpus, gpus_per_node=gpus, train_fixed_s=c["train_fixed_s"],
                      train_tokens_per_s=c["train_tokens_per_s"], weight_sync_s=c["weight_sync_s"],
                      reward_latency_s=c["reward_latency_s"], round_start_s=c["round_start_s"],
                      engine_slowdown=list(c.get("engine_slowdown", [])), engine_jitter=c.get("engine_jitter", 0.0))
    workload = WorkloadConfig(kind="replay", replay_path=str(lengths_path), num_prompts=cal.fit["prompts"],
                              num_epochs=cal.fit["epochs"], prompt_tokens=max(1, round(cal.prompt_tokens)),
                              seed=sim.workload.seed)
    return replace(sim, engine=engine, cluster=cluster, workload=workload)


def calibrate_probe(run_dir: str | Path) -> float | None:
    """`probe_seconds` of a run directory's timeline."""
    return probe_seconds(read_run_timeline(Path(run_dir)))


def kv_bytes_per_token(model_path: str, dtype_bytes: int = 4) -> float | None:
    """2 * layers * kv_heads * head_dim * dtype bytes from a Hugging Face config.json (None if unreadable)."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return float(2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * dtype_bytes)
    except (OSError, KeyError, ValueError, TypeError, ZeroDivisionError):
        return None


def _scenario(sim: Any, run: Any, cal: Calibration, lengths_path: Path) -> Any:
    """`sim` with `cal`'s costs and replay table, sized as run config `run` (engines, KV cache, batch)."""
    kv = kv_bytes_per_token(run.model.path, 4 if run.model.dtype == "float32" else 2)
    if kv:
        sim = replace(sim, engine=replace(sim.engine, kv_bytes_per_token=kv))
    sim = replace(sim, engine=replace(sim.engine, max_num_seqs=run.rollout.max_num_seqs))
    sim = apply_calibration(sim, cal, lengths_path, tp=run.rollout.tensor_parallel_size,
                            kv_cache_gib=run.rollout.kv_cache_gib)
    if int(cal.cluster["gpus"]) != run.rollout.num_workers:  # an engine that got no request still counts
        gpus = run.rollout.num_workers * run.rollout.tensor_parallel_size
        sim = replace(sim, cluster=replace(sim.cluster, gpus=gpus, gpus_per_node=gpus))
    return sim


def _slowed(cal: Calibration, k: float, gpus: int) -> Calibration:
    slow = list(cal.cluster.get("engine_slowdown") or []) or [1.0]
    slow += [1.0] * (gpus - len(slow))
    return replace(cal, cluster={**cal.cluster, "engine_slowdown": [k * x for x in slow]})


def rollout_seconds(events: Sequence[Event]) -> float:
    """Seconds of the rollout phases that ended (a run's last, unclosed rollout phase found no data)."""
    ended = {(e.step, e.phase) for e in events if e.kind == "phase" and e.event == "end"}
    from megatron_sortedrl.telemetry.timeline import phase_intervals

    return sum(b - a for s, p, a, b in phase_intervals(events) if p == "rollout" and (s, p) in ended)


def draws_of(sim: Any, draws: int) -> list[Any]:
    """`sim` once per draw of the engines' round-to-round speeds (workload seeds seed, seed+1, ...); one when
    the engines are steady (no jitter, nothing to draw)."""
    n = draws if sim.cluster.engine_jitter > 0 else 1
    return [replace(sim, workload=replace(sim.workload, seed=sim.workload.seed + i)) for i in range(n)]


def match_rollout_level(sim: Any, run_dir: str | Path, cal: Calibration, out_dir: str | Path, rounds: int = 3,
                        draws: int = 5) -> Calibration:
    """`cal` (measured on `run_dir`) with every engine's speed scaled so that replaying `run_dir` itself
    spends as many seconds in rollout as the run did.

    Why: the decode fit matches each request's step count between its first token and its end, so it sets
    the shape of the step time (batch, context, prefill) and an average speed; when the step time jitters
    (a CPU shared with other jobs) that average is not the one that sums to the measured rollout time, and
    every policy predicted from these costs inherits the error. The level (one factor on all engines) is
    found by simulating the run and rescaling by measured / simulated rollout seconds, a few times, since
    round start and harvest latency do not scale; with engine jitter the simulated seconds are the mean over
    `draws` draws of it. On a simulated run the factor is 1 (tests/test_calibrate.py)."""
    from megatron_sortedrl.config import load_config
    from scheduler.sim.simulator import simulate

    run_dir = Path(run_dir)
    run = load_config(run_dir / "config.yaml", [])
    target = rollout_seconds(read_run_timeline(run_dir))
    gpus = run.rollout.num_workers
    k, got = 1.0, None
    for _ in range(rounds):
        scen = _scenario(sim, run, _slowed(cal, k, gpus), Path(out_dir) / "level_lengths.json")
        got = statistics.mean(rollout_seconds(simulate(x, run).events) for x in draws_of(scen, draws))
        if target <= 0 or got <= 0 or abs(got / target - 1) < 1e-3:
            break
        k *= target / got
    k = min(max(k, 0.2), 5.0)  # a run this far off its own replay is a measurement problem, not a level
    out = _slowed(cal, k, gpus)
    return replace(out, fit={**out.fit, "level_scale": k, "level_rollout_s": target, "level_sim_rollout_s": got})


def calibrated_scenario(sim: Any, run_dir: str | Path, out_dir: str | Path, run_overrides: list[str] | None = None,
                        costs_from: str | Path | None = None, probe: bool = False,
                        match_level: bool = False) -> tuple[Any, Any, Calibration]:
    """(SimConfig, RunConfig, Calibration) that replay run `run_dir`: its own run config (`config.yaml`, plus
    `run_overrides`), its response lengths, and the costs measured on `costs_from` (default: the same run).
    `match_level`: engine speed set so that the costs' run replays with its own rollout seconds
    (`match_rollout_level`); `probe`: engines scaled by the ratio of the two runs' pre-RL evaluations
    (`scale_to_probe`). The replay table goes to `out_dir/lengths.json`."""
    from megatron_sortedrl.config import load_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--calibrate-from {run_dir}: no config.yaml there; give the run directory of a `train` run")
    run = load_config(run_dir / "config.yaml", list(run_overrides or []))
    cal = calibrate_run(run_dir, default_prompt_tokens=sim.workload.prompt_tokens)
    source = Path(costs_from) if costs_from is not None else run_dir
    other = cal if source == run_dir else calibrate_run(source, default_prompt_tokens=sim.workload.prompt_tokens)
    if match_level:
        other = match_rollout_level(sim, source, other, out_dir)
    if source != run_dir:
        cal = replace(other, lengths=cal.lengths, prompt_tokens=cal.prompt_tokens,
                      fit={**other.fit, "prompts": cal.fit["prompts"], "epochs": cal.fit["epochs"],
                           "costs_from": str(costs_from)})
        if probe:  # the engines ran as fast as the pre-RL evals say, not as fast as during `costs_from`
            cal = scale_to_probe(cal, calibrate_probe(run_dir), run.rollout.num_workers)
    else:
        cal = other
    sim = _scenario(sim, run, cal, Path(out_dir) / "lengths.json")
    return sim, run, cal


# Cost groups of a calibration, as `(name, engine keys, cluster keys)`: the unit in which a prediction's
# error is attributed (`with_costs_of`).
COST_GROUPS = (("engine speed", ("step_overhead_s", "per_seq_s", "kv_s_per_token", "prefill_tokens_per_s"),
                ("engine_slowdown", "engine_jitter")),
               ("train step", (), ("train_fixed_s", "train_tokens_per_s")),
               ("per-update other (sync, history, gaps)", (), ("weight_sync_s",)),
               ("round start + harvest latency", (), ("round_start_s", "reward_latency_s")))


def with_costs_of(cal: Calibration, other: Calibration, group: str) -> Calibration:
    """`cal` with the costs of one `COST_GROUPS` group taken from `other`."""
    _, engine_keys, cluster_keys = next(g for g in COST_GROUPS if g[0] == group)
    return replace(cal, engine={**cal.engine, **{k: other.engine[k] for k in engine_keys}},
                   cluster={**cal.cluster, **{k: other.cluster[k] for k in cluster_keys if k in other.cluster}})


def replay_scenario(sim: Any, run_dir: str | Path, cal: Calibration, out_dir: str | Path) -> tuple[Any, Any]:
    """(SimConfig, RunConfig) replaying run `run_dir` (its config and response lengths) with `cal`'s costs."""
    from megatron_sortedrl.config import load_config

    own = calibrate_run(run_dir, default_prompt_tokens=sim.workload.prompt_tokens)
    run = load_config(Path(run_dir) / "config.yaml", [])
    cal = replace(cal, lengths=own.lengths, prompt_tokens=own.prompt_tokens,
                  fit={**cal.fit, "prompts": own.fit["prompts"], "epochs": own.fit["epochs"]})
    return _scenario(sim, run, cal, Path(out_dir) / "lengths.json"), run


def describe(cal: Calibration, run_dir: str | Path) -> str:
    """A few lines naming the measured costs (printed by `simulate --calibrate-from`)."""
    f, e, c = cal.fit, cal.engine, cal.cluster
    return (f"calibrated from {run_dir}: {f['requests']} requests, {f['steps']} steps, {f['prompts']} prompts x "
            f"{f['epochs']} epochs replayed\n"
            f"  decode step = {1e3 * e['step_overhead_s']:.3f} ms + {1e3 * e['per_seq_s']:.4f} ms x batch + "
            f"{1e6 * e['kv_s_per_token']:.4f} us x context tokens (fit error {f['decode_rel_rms']:.1%} rms of a "
            f"request's tokens)\n"
            f"  prefill {e['prefill_tokens_per_s']:.0f} tokens/s; train {c['train_fixed_s']:.3f} s + tokens / "
            f"{c['train_tokens_per_s']:.0f}/s; weight sync and other per-update {c['weight_sync_s']:.3f} s; "
            f"reward/harvest latency {1e3 * c['reward_latency_s']:.1f} ms; engine speed {c.get('engine_jitter', 0.0):.2f} "
            "log-sd round to round"
            + (f"; engines x{f['level_scale']:.3f} to match the run's rollout seconds" if "level_scale" in f else ""))


def write_sim_run(result: Any, run_dir: str | Path) -> Path:
    """Writes a simulated run as a run directory (timeline.jsonl, and metrics.jsonl rows naming each step's
    trained samples), so that `calibrate_run` can be checked against costs it should recover."""
    from megatron_sortedrl.telemetry.timeline import TimelineWriter

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "timeline.jsonl").unlink(missing_ok=True)  # the writer appends
    with TimelineWriter(run_dir / "timeline.jsonl") as w:
        for e in result.events:
            w.write(e)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in result.rounds:
            f.write(json.dumps({"step": row["round"], "reward/per_sample": {s: 0.0 for s in row["sample_ids"]}}) + "\n")
    return run_dir
