"""The physical limit of a simulator scenario: a lower bound on time per trained sample for any policy.

    from scheduler.sim.limit import physical_limit
    lim = physical_limit(sim, run)            # {"total_s", "s_per_sample", "rollout_s", "train_s", ...}
    python -m megatron_sortedrl simulate ... / benchmarks/simulate_policies.py report rows' `ratio_to_limit`

What every colocated synchronous schedule of the scenario must spend, whatever the policy (trainer and
rollout share the GPUs, so their times add):

- **Generation**, at least the larger of
  - *throughput*: every trained sample's response tokens at the engines' best tokens/s per GPU on all GPUs:
    the best over TP (powers of two that hold the weights, up to a node), batch B (up to `max_num_seqs` and
    the KV room of B shortest prompts) and draft length k, of ``B * f(k) / step(tp, B * (k + 1), B * prompt_min)``
    per TP group, with f(k) the tokens per forward at the speculation model's best acceptance
    (`speculation.alpha_cap`; only k = 0 when speculation is off), step the engine cost model's
    verification step, context only the prompts (the least KV any step reads);
  - *latency*: the longest response decoded alone (batch 1) at the fastest TP and draft length, its context
    growing from its prompt: no round that holds it can be shorter.
- **Training**: every trained token at `train_tokens_per_s` (once per `ppo_epochs`), plus `train_fixed_s` and
  `weight_sync_s` for the fewest harvests any policy can make (all prompt instances / the largest harvest,
  max(rollout_batch_size, group_size) prompts), plus `optimizer_step_s` for every optimizer step, which with
  mini-batches (`algorithm.ppo_mini_batch_size`) every policy makes alike: ceil(samples / mini-batch) x epochs.

The **any-placement** bound (`any_placement_total_s`) is the one for the disaggregated placement (trainer GPUs of
their own, training streamed while the engines generate, `scheduler/sim/stream_sim.py`): generation and token
training overlap, so it charges them as GPU time on all GPUs, at least the longest response, plus every update's
`train_fixed_s` and `weight_sync_s` (the rounds stay synchronous, nothing overlaps those). It is never above
the colocated bound and equals it when generation is throughput bound.

Trajectories (`workload.turns_max` > 1, `scheduler/sim/trajectory_sim.py`): throughput counts the decoded tokens (the
assistant turns), training every token of the trajectory (tool messages included), and the latency term is the
longest critical path, a trajectory's turns decoded alone plus its tool latencies.

Responses are each sample's first drawn length (a policy that restarts a sample draws a fresh one; the
test checks the bound holds for every policy, restarts included). Prefill, reward latency and re-layout are
left out (a bound may only leave costs out).

The **overlapped** bound (`overlapped_limit`, asynchronous rows of scheduler/sim/async_sim.py): with N trainer GPUs
and the rest generating, the larger of generation on the engines' GPUs and training on the trainer's.

Left out: a per-epoch latency term (policies that carry prompts across rounds may run a prompt's next
epoch while its previous one is still generating, so only one longest response is certain).
"""

from __future__ import annotations

import math
from typing import Any

from megatron_sortedrl.config import RunConfig
from scheduler.cost_model import EngineCostModel
from scheduler.sim.sim_config import SimConfig
from scheduler.sim.trajectory_sim import TurnLevel, draw_trajectory
from scheduler.sim.speculation_model import SpeculationConfig, emitted
from scheduler.sim.workload import make_workload


def _tps(model: EngineCostModel, gpus_per_node: int, gpus: int) -> list[int]:
    tps, tp = [], model.min_tp()
    while tp <= min(gpus_per_node, gpus):
        tps.append(tp)
        tp *= 2
    return tps or [model.min_tp()]


def _draft_lengths(spec: SpeculationConfig | None) -> list[tuple[int, float]]:
    if spec is None:
        return [(0, 1.0)]
    return [(k, emitted(spec.alpha_cap, k)) for k in range(spec.max_draft_tokens + 1)]


def best_tokens_per_gpu_s(model: EngineCostModel, tps: list[int], prompt_min: int,
                          spec: SpeculationConfig | None) -> dict[str, Any]:
    """Highest tokens/s per GPU any engine step can reach (see the module docstring)."""
    best = {"tokens_per_gpu_s": 0.0}
    for tp in tps:
        cap = model.kv_capacity(tp)
        bmax = min(model.max_num_seqs, max(1, cap // max(1, prompt_min)))
        for k, f in _draft_lengths(spec):
            # Throughput grows with B (fixed costs amortised, per-position cost linear): check the ends and a
            # geometric sweep in between rather than every B.
            cands = sorted({bmax, 1, *(int(bmax / 2**i) for i in range(1, 12) if bmax / 2**i >= 1)})
            for b in cands:
                step = model.verify_step_s(tp, b * (k + 1), b * prompt_min)
                rate = b * f / step / tp
                if rate > best["tokens_per_gpu_s"]:
                    best = {"tokens_per_gpu_s": rate, "tp": tp, "batch": b, "draft_tokens": k}
    return best


def latency_s(model: EngineCostModel, tps: list[int], prompt: int, length: int, spec: SpeculationConfig | None) -> dict[str, Any]:
    """Fastest time to decode one `length`-token response alone (context grows from `prompt`)."""
    best = {"seconds": math.inf}
    for tp in tps:
        for k, f in _draft_lengths(spec):
            steps = length / f
            # step time is linear in context: integrate it over the response (mean context prompt + length/2)
            sec = steps * model.verify_step_s(tp, k + 1, prompt + length / 2)
            if sec < best["seconds"]:
                best = {"seconds": sec, "tp": tp, "draft_tokens": k}
    return best


def physical_limit(sim: SimConfig, run: RunConfig, speculation: bool = True, workload: Any = None) -> dict[str, Any]:
    """The scenario's lower bound (module docstring); `speculation=False` leaves drafts out of the engines."""
    wl = workload or make_workload(sim.workload, run.rollout.max_response_length)
    n, epochs = run.rollout.n_samples_per_prompt, sim.workload.num_epochs
    prompts = {pid: wl.prompt_tokens(pid) for pid in wl.prompt_ids}
    resp_tokens = train_tokens = 0
    longest = (0, 1)  # (length, its prompt)
    level = TurnLevel(sim.workload) if sim.workload.turns_max > 1 else None
    paths = []  # trajectories: (tool seconds, decoded tokens, prompt) of each sample
    for pid, ptoks in prompts.items():
        for e in range(epochs):
            for i in range(n):
                if level is None:
                    length = total = wl.length(pid, e, i, 0)
                else:
                    traj = draw_trajectory(wl, level, pid, e, i, 0, run.rollout.max_response_length)
                    length, total = sum(traj.turns), traj.total
                    paths.append((traj.tool_s, length, ptoks))
                resp_tokens += length
                train_tokens += total + ptoks
                longest = max(longest, (length, ptoks))
    samples = len(prompts) * n * epochs
    model, c = sim.engine, sim.cluster
    spec = sim.speculation if speculation else None
    tps = _tps(model, c.gpus_per_node, c.gpus)
    thr = best_tokens_per_gpu_s(model, tps, min(prompts.values()), spec)
    throughput_s = resp_tokens / (thr["tokens_per_gpu_s"] * c.gpus)
    lat = latency_s(model, tps, longest[1], longest[0], spec)
    if paths:  # the longest critical path: a trajectory's turns decoded alone plus its tool calls
        lat = max(({**latency_s(model, tps, p, g, spec), "tool_s": t} for t, g, p in paths),
                  key=lambda d: d["seconds"] + d["tool_s"])
        lat["seconds"] += lat["tool_s"]
    per_update = max(run.scheduler.rollout_batch_size, run.scheduler.group_size)
    updates = math.ceil(len(prompts) * epochs / per_update)
    a = run.algorithm
    steps = (math.ceil(samples / a.ppo_mini_batch_size) if a.ppo_mini_batch_size else updates) * a.ppo_epochs
    train_s = updates * c.train_fixed_s + steps * c.optimizer_step_s + train_tokens * a.ppo_epochs / c.train_tokens_per_s
    sync_s = updates * c.weight_sync_s
    rollout_s = max(throughput_s, lat["seconds"])
    total = rollout_s + train_s + sync_s
    # Any placement (disaggregated stream training overlaps generation and training): GPU time of both on all GPUs,
    # and no less than the longest response, plus each update's step and sync, which nothing overlaps.
    token_train_s = train_tokens * a.ppo_epochs / c.train_tokens_per_s
    fixed_s = updates * c.train_fixed_s + steps * c.optimizer_step_s
    any_total = max(throughput_s + token_train_s, lat["seconds"]) + fixed_s + sync_s
    return {"total_s": total, "s_per_sample": total / samples, "samples": samples, "rollout_s": rollout_s,
            "any_placement_total_s": any_total, "any_placement_s_per_sample": any_total / samples,
            "rollout_bound": "latency" if lat["seconds"] >= throughput_s else "throughput",
            "throughput_s": throughput_s, "latency_s": lat["seconds"], "train_s": train_s, "sync_s": sync_s,
            "updates": updates, "optimizer_steps": steps, "response_tokens": resp_tokens, "train_tokens": train_tokens,
            "longest_response": longest[0], "best_engine": thr, "latency_engine": lat,
            "speculation": speculation, "gpus": c.gpus, "token_train_s": token_train_s,
            "step_fixed_s": steps * c.optimizer_step_s}


def overlapped_limit(limit: dict[str, Any], trainer_gpus: int) -> dict[str, Any]:
    """The bound of an overlapped (asynchronous) schedule with `trainer_gpus` GPUs training and the rest
    generating: the larger of generation on the engines' GPUs (throughput on their share, at least the longest
    response) and training on the trainer's (every token at its share of the cluster rate, every optimizer step's
    fixed cost). Weight pushes and per-call fixed costs are left out (a bound may leave costs out)."""
    g = limit["gpus"]
    if not 0 < trainer_gpus < g:
        raise ValueError(f"trainer_gpus must be between 0 and {g} (got {trainer_gpus})")
    gen = max(limit["throughput_s"] * g / (g - trainer_gpus), limit["latency_s"])
    train = limit["token_train_s"] * g / trainer_gpus + limit["step_fixed_s"]
    total = max(gen, train)
    return {"total_s": total, "s_per_sample": total / limit["samples"], "generation_s": gen, "training_s": train,
            "bound": "generation" if gen >= train else "training", "trainer_gpus": trainer_gpus}


def add_limit(rows: list[dict[str, Any]], limit: dict[str, Any]) -> list[dict[str, Any]]:
    """`ratio_to_limit` (time per trained sample / the limit's) on every row; a row with `placement` "disaggregated"
    is measured against the any-placement bound, an asynchronous one (`placement` "async") against the overlapped
    bound at its split (`overlapped_limit`)."""
    for r in rows:
        per_sample = r["total_s"] / r["samples"] if r.get("samples") else math.inf
        if r.get("placement") == "async":  # against the overlapped bound at the row's own split
            r["overlapped_limit_s_per_sample"] = overlapped_limit(limit, r["trainer_gpus"])["s_per_sample"]
            r["ratio_to_limit"] = per_sample / r["overlapped_limit_s_per_sample"]
            continue
        key = "any_placement_s_per_sample" if r.get("placement") == "disaggregated" else "s_per_sample"
        r["ratio_to_limit"] = per_sample / limit[key]
    return rows
