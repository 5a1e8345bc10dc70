"""Speed-ups at equal footing: every policy against the best `sync`, at the same samples per optimizer step.

    from scheduler.sim.equal_footing import compare
    rows, results = compare(sim, run, ["sync", "twotier", "twotier+histospec"])   # adds sync@<B>, x_best_sync
    python -m megatron_sortedrl simulate configs/sim_qwen32b_128gpu.yaml --policies sync,twotier,twotier+histospec

Why: with one optimizer step per harvest the number and size of updates followed each policy's round size, so a
policy that harvested larger rounds looked faster partly because it made fewer, larger updates, a speed-up `sync`
gets by raising its own batch. Here:

- every policy trains in mini-batches of `run.algorithm.ppo_mini_batch_size` samples (the simulator cuts each
  harvest as the driver does, `megatron_sortedrl/minibatch.py`), so on the same data every policy makes the same
  optimizer steps (the `updates` column; the property test in tests/test_equal_footing.py checks it);
- `sync` runs twice: at its recipe's rollout batch (`scheduler.rollout_batch_size`) and at a rollout batch equal
  to the default policy's mean harvest (in prompts, rounded; the row `sync@b<B>`, `sync+histospec@b<B>`), the
  way a `sync` user would amortise the long tail by raising the batch;
- `x_best_sync` is each row's throughput over the better of those two plain `sync` rows; a `+histospec` row also
  gets `x_best_sync_histospec`, the ratio to the better `sync+histospec` when those rows ran. Each row carries
  `max_staleness_steps` (optimizer steps between a trained sample's weights and its step).

Left out: choosing sync's batch by search (two points: the recipe's and the default's harvest).
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import Any, Callable

from scheduler.sim.report import summarize
from scheduler.sim.speculation_model import split_policy


def mean_harvest_prompts(result: Any, n: int) -> int:
    """The mean harvest (samples per harvest that trained) of a simulated run, in prompts of n samples."""
    harvests = [r["samples"] for r in result.rounds if r.get("optimizer_steps")]
    if not harvests:
        return 1
    return max(1, round(sum(harvests) / len(harvests) / n))


def sync_at(run: Any, prompts: int) -> Any:
    """The run config with `sync`'s rollout batch set to `prompts` (the update batch kept within one round)."""
    s = run.scheduler
    return replace(run, scheduler=replace(s, rollout_batch_size=prompts,
                                          update_batch_size=min(s.update_batch_size, prompts * run.rollout.n_samples_per_prompt)))


def policy_of(label: str) -> tuple[str, bool]:
    """(tier-1 policy, speculative) of a row label such as `sync+histospec@b384` (`@<variant>`: a row's variant)."""
    return split_policy(label.partition("@")[0])


def sync_batch_label(label: str) -> bool:
    """A plain `sync` row at some rollout batch: `sync`, `sync@b<B>` (and their `+histospec` forms)."""
    variant = label.partition("@")[2]
    return policy_of(label)[0] == "sync" and (not variant or re.fullmatch(r"b\d+", variant) is not None)


def pooled_labels(labels: list[str]) -> dict[str, str]:
    """Each per-seed row label -> the label its rows pool under across seeds. `sync@b<B>` follows each seed's
    harvest, so B may differ between seeds: those rows pool as `sync@b<B>` when every seed had the same B, else as
    `sync@b<min>-<max>` (the same for `sync+histospec@b<B>`); other labels pool as themselves."""
    batches: dict[str, set[int]] = {}
    for label in labels:
        base, _, variant = label.partition("@")
        if variant and sync_batch_label(label):
            batches.setdefault(base, set()).add(int(variant[1:]))
    out = {}
    for label in labels:
        base, _, variant = label.partition("@")
        if variant and sync_batch_label(label):
            lo, hi = min(batches[base]), max(batches[base])
            out[label] = f"{base}@b{lo}" if lo == hi else f"{base}@b{lo}-{hi}"
        else:
            out[label] = label
    return out


def add_best_sync(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`x_best_sync` (and `best_sync`) on every row: the ratio to the faster plain `sync` batch row (other `sync@`
    variants, with mechanisms of their own, are rows like any other); `x_best_sync_histospec` on `+histospec` rows."""
    def best(spec: bool) -> dict[str, Any] | None:
        cands = [r for r in rows if sync_batch_label(r["policy"]) and policy_of(r["policy"])[1] == spec]
        return max(cands, key=lambda r: r["samples_per_s"], default=None)

    plain, spec = best(False), best(True)
    for r in rows:
        if plain and plain["samples_per_s"]:
            r["x_best_sync"] = r["samples_per_s"] / plain["samples_per_s"]
            r["best_sync"] = plain["policy"]
        if spec and spec["samples_per_s"] and policy_of(r["policy"])[1]:
            r["x_best_sync_histospec"] = r["samples_per_s"] / spec["samples_per_s"]
    return rows


def compare(sim: Any, run: Any, policies: list[str], simulate: Callable | None = None,
            on_result: Callable[[str, Any, dict], None] | None = None) -> tuple[list[dict], list[Any]]:
    """Simulates `policies`, then each `sync` variant among them again at the default policy's mean harvest
    (`sync@b<B>`, the default is `run.scheduler.policy`, or the first non-sync policy when it did not run);
    returns (rows with `x_best_sync` and `sim_wall_s`, the seconds each simulation took, results) in that order.
    `simulate(sim, run, policy)` gets the row's label as `policy` (a `sync@b<B>` row: its sync policy)."""
    if simulate is None:
        from scheduler.sim.simulator import simulate
    rows, results = [], []

    def one(label: str, cfg: Any, policy: str) -> Any:
        t0 = time.time()
        res = simulate(sim, cfg, policy)
        res.policy = label
        row = summarize(res)
        row["sim_wall_s"] = round(time.time() - t0, 1)
        if on_result is not None:
            on_result(label, res, row)
        rows.append(row)
        results.append(res)
        return res

    by_name = {p: one(p, run, p) for p in policies}
    default = run.scheduler.policy if run.scheduler.policy in by_name else next(
        (p for p in policies if split_policy(p)[0] != "sync"), None)
    syncs = [p for p in policies if split_policy(p)[0] == "sync"]
    if default is not None and syncs:
        b = mean_harvest_prompts(by_name[default], run.rollout.n_samples_per_prompt)
        if b != run.scheduler.rollout_batch_size:
            for p in syncs:
                label = f"{p}@b{b}"
                one(label, sync_at(run, b), p)
    return add_best_sync(rows), results
