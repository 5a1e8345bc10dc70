"""Simulation benchmark: every tier-1 policy, and sync / twotier with HistoSpec, on two scales, against the
physical limit; figures committed to docs/benchmarks/.

    nice .venv/bin/python benchmarks/simulate_policies.py            # about five minutes on 2 CPU cores
    nice .venv/bin/python benchmarks/simulate_policies.py qwen32b_128gpu
    nice .venv/bin/python benchmarks/simulate_policies.py paper_rollpacker_14b_16k   # a scenario not tuned for

Scales: the 2-core CPU default (configs/sim_tiny_cpu.yaml), Qwen2.5-32B on 128 GPUs with 32k-token
tails (configs/sim_qwen32b_128gpu.yaml) and, only when named, RollPacker's 14B/16k setting on 64 GPUs with
lookahead on (configs/sim_paper_rollpacker_14b_16k.yaml; nothing was tuned on it). Writes docs/benchmarks/simulation_<scale>.json and .png:

- `rows`: one per variant, every one at the scenario's mini-batch (`algorithm.ppo_mini_batch_size`: the same
  optimizer steps for all, `updates`), with `x_best_sync` (samples/s over the better of sync at its recipe batch
  and `sync@b<B>`, sync at twotier's mean harvest of B prompts; `x_best_sync_histospec` the same against the
  HistoSpec sync rows; scheduler/sim/equal_footing.py), `max_staleness_steps`, `throughput_vs_sync` (samples/s over
  sync's at its recipe batch, same run) and
  `ratio_to_limit` (time per trained sample over the physical limit's, `scheduler/sim/limit.py`, with the
  scenario's speculation at its best acceptance, so a lower bound for every row; its any-placement form
  for the disaggregated row). The plain policies run the scenario as is; `<policy>@<variant>` rows add the
  round-tail mechanisms: `@migration` tail migration (`scheduler/sim/tail_migration.py`), `@system` tail
  migration + colocated stream training, `@disaggregated` tail migration + stream training on trainer GPUs
  of their own (`TRAINER_SHARE` of the GPUs, whole nodes; `scheduler/sim/stream_sim.py`). `sync@system` is the
  baseline with the same mechanisms (`throughput_vs_sync_same_mechanisms`). `worker_idle_s_by_round`: idle
  worker-seconds per round, the worker bubble's numerator, to show where it is;
- `limit`: the bound with and without speculation, and its parts;
- `speculation`: the model's calibration (`speculation:` of the scenario), tokens/s of one engine with and
  without HistoSpec by number of running sequences (where it pays: few sequences, the long tail), and
  `tail` with and without HistoSpec, rollout time by round kind (its long rounds run few sequences per
  engine). `--evidence-only` recomputes just that block into an existing JSON.

    nice .venv/bin/python benchmarks/simulate_policies.py --tail-ablation configs/sim_paper_rollpacker_14b_16k.yaml

writes docs/benchmarks/tail_ablation_<scenario>.json: sync and twotier+HistoSpec without the round-tail changes,
with sibling drafts only, and with sibling drafts and `scheduler.lookahead` (`tail_ablation`).

The simulator is deterministic: one run per variant (no repeats needed; wall time is the simulator's own).
Left out: accuracy effects of the policies (the simulator has no model).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.sim.equal_footing import add_best_sync, mean_harvest_prompts, sync_at, sync_batch_label  # noqa: E402
from scheduler.sim.limit import add_limit, physical_limit  # noqa: E402
from scheduler.sim.report import add_ratios, format_table, plot, summarize  # noqa: E402
from scheduler.sim.sim_config import load_sim_config  # noqa: E402
from scheduler.sim.simulator import simulate  # noqa: E402
from scheduler.sim.speculation_model import HistoSpecSim, SpeculationConfig, chain  # noqa: E402

SCALES = {"tiny_cpu": "configs/sim_tiny_cpu.yaml", "qwen32b_128gpu": "configs/sim_qwen32b_128gpu.yaml",
          # Not tuned for: the RollPacker 14B/16k setting as its YAML has it, with the 32B scenario's lookahead.
          "paper_rollpacker_14b_16k": "configs/sim_paper_rollpacker_14b_16k.yaml"}
SCALE_OVERRIDES = {"paper_rollpacker_14b_16k": ["run.scheduler.lookahead=true"]}
POLICIES = ("sync", "sorted", "tail", "twotier", "sync+histospec", "twotier+histospec",
            "sync@system", "twotier+histospec@migration", "twotier+histospec@system", "twotier+histospec@disaggregated")
# The round-tail mechanisms on top of a policy (`<policy>@<variant>` rows; the plain rows run the scenario as is):
TRAINER_SHARE = 0.75  # disaggregated: trainer GPUs, rounded down to whole nodes (chosen on the 32B scenario, see docs)


def variant_overrides(name: str, sim) -> list[str] | None:
    """Config overrides of a `<policy>@<variant>` row (None: the scenario cannot form it)."""
    variant = name.partition("@")[2]
    if not variant:
        return []
    migrate, stream = ["cluster.tail_migration=true"], ["cluster.stream_training=true"]
    if variant == "migration":  # tail migration only (scheduler/sim/tail_migration.py)
        return migrate
    if variant == "system":  # tail migration + colocated stream training (scheduler/sim/stream_sim.py)
        return migrate + stream
    if variant == "disaggregated":  # tail migration + stream training on trainer GPUs of their own
        c = sim.cluster
        trainer = int(c.gpus * TRAINER_SHARE) // c.gpus_per_node * c.gpus_per_node
        if not 0 < trainer <= c.gpus - c.gpus_per_node:
            return None
        return migrate + stream + [f"cluster.trainer_gpus={trainer}"]
    raise ValueError(f"unknown variant {variant!r}")


def speedup_by_batch(sim, tp: int, ages: tuple[float, ...] = (0.0, 2.0, 8.0)) -> list[dict]:
    """One engine's decode tokens/s with and without HistoSpec by running sequences (context ~3k each)."""
    spec = HistoSpecSim(sim.speculation)
    out = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        if b > sim.engine.max_num_seqs:
            break
        ctx = b * 3000.0
        plain = b / sim.engine.decode_step_s(tp, b, ctx)
        row = {"batch": b, "tp": tp, "plain_tokens_per_s": plain}
        for age in ages:
            c: SpeculationConfig = sim.speculation
            rate, drafted, _ = chain(round(c.alpha(age), 3), c.min_draft_tokens, c.max_draft_tokens)
            fast = b * rate / spec.step_s(sim.engine, tp, b, b * (1 + drafted), ctx)
            row[f"speedup_age{age:g}"] = fast / plain
        out.append(row)
    return out


def idle_by_round(result) -> list[float]:
    """Idle worker-seconds of each round's rollout phase (the worker bubble's numerator, round by round): where the
    bubble is, e.g. the last round, which has no next window to look ahead to."""
    from megatron_sortedrl.telemetry.timeline import phase_window, worker_bubble_ratio

    by: dict[int, list] = {}
    for e in result.events:
        by.setdefault(e.step, []).append(e)
    out = []
    for step in sorted(by):
        w = phase_window(by[step], step, "rollout")
        workers = {e.worker for e in by[step] if e.kind == "request" and e.worker is not None}
        if w is None or not workers:
            continue
        out.append(round(worker_bubble_ratio(by[step], step) * len(workers) * (w[1] - w[0]), 1))
    return out


def by_kind(result) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in result.rounds:
        out[r["kind"]] = out.get(r["kind"], 0.0) + r["rollout_s"]
    return out


def long_round_evidence(sim, run) -> dict:
    """`tail` runs explicit long rounds (few sequences per engine): its rollout time by round kind with and
    without HistoSpec shows where speculation pays."""
    out = {}
    for name in ("tail", "tail+histospec"):
        result = simulate(sim, run, name, record=False)
        out[name] = {"rollout_s_by_kind": by_kind(result), "total_s": result.total_s}
        print(f"  {name}: {result.total_s:.0f} s {out[name]['rollout_s_by_kind']}", flush=True)
    plain, spec = out["tail"]["rollout_s_by_kind"], out["tail+histospec"]["rollout_s_by_kind"]
    out["rollout_speedup_by_kind"] = {k: plain[k] / spec[k] for k in plain if spec.get(k)}
    return out


def tail_ablation(path: str) -> dict:
    """twotier+HistoSpec with the round-tail changes off, one at a time and both (sibling drafts in the simulator,
    `scheduler.lookahead`), against sync and the physical limit of the scenario at `path`."""
    from dataclasses import replace

    out: dict = {"config": path}
    variants = [("sync", "sync", True, True), ("before (neither)", "twotier+histospec", False, False),
                ("sibling drafts only", "twotier+histospec", True, False),
                ("sibling drafts + lookahead", "twotier+histospec", True, True)]
    for label, policy, siblings, lookahead in variants:
        sim, run = load_sim_config(ROOT / path, [f"run.scheduler.lookahead={str(lookahead).lower()}"])
        sim = replace(sim, speculation=replace(sim.speculation, sibling_drafts=siblings))
        s = summarize(simulate(sim, run, policy))
        out[label] = {k: s[k] for k in ("policy", "total_s", "samples", "worker_bubble", "slot_bubble", "rounds",
                                        "max_staleness")}
        print(f"  {label}: {s['total_s']:.0f} s", flush=True)
    limit = physical_limit(sim, run)
    for label, *_ in variants:
        r = out[label]
        r["throughput_vs_sync"] = out["sync"]["total_s"] / r["total_s"]
        r["ratio_to_limit"] = r["total_s"] / r["samples"] / limit["s_per_sample"]
    out["limit"] = limit
    return out


def main(argv: list[str]) -> int:
    out = ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    if "--tail-ablation" in argv:  # a scenario not tuned for: which of the round-tail changes buys what
        path = argv[argv.index("--tail-ablation") + 1]
        doc = tail_ablation(path)
        (out / f"tail_ablation_{Path(path).stem.removeprefix('sim_')}.json").write_text(json.dumps(doc, indent=1))
        return 0
    if "--evidence-only" in argv:  # adds the long-round evidence to an existing JSON without rerunning the rows
        argv = [a for a in argv if a != "--evidence-only"]
        for scale, path in SCALES.items():
            if argv and scale not in argv:
                continue
            sim, run = load_sim_config(ROOT / path)
            f = out / f"simulation_{scale}.json"
            doc = json.loads(f.read_text())
            doc["speculation"]["long_round_evidence"] = long_round_evidence(sim, run)
            f.write_text(json.dumps(doc, indent=1))
        return 0
    scales = [a for a in argv if not a.startswith("--")]
    for scale, path in SCALES.items():
        if (scales and scale not in scales) or (not scales and scale in SCALE_OVERRIDES):
            continue  # with no scale named: the two committed scales only
        base_over = SCALE_OVERRIDES.get(scale, [])
        sim, run = load_sim_config(ROOT / path, base_over)
        rows, results = [], []
        # equal footing (scheduler/sim/equal_footing.py): sync again at twotier's mean harvest, sync+histospec too
        harvest = []
        for name in list(POLICIES) + ["sync@harvest", "sync+histospec@harvest"]:
            if name.endswith("@harvest"):
                if not harvest or harvest[0] == run.scheduler.rollout_batch_size:
                    continue
                name = name.replace("@harvest", f"@b{harvest[0]}")
                vsim, vrun = sim, sync_at(run, harvest[0])
                over = [f"run.scheduler.rollout_batch_size={harvest[0]}"]
            else:
                over = variant_overrides(name, sim)
                if over is None:
                    continue
                vsim, vrun = load_sim_config(ROOT / path, base_over + over) if over else (sim, run)
            t0 = time.time()
            result = simulate(vsim, vrun, name.partition("@")[0])
            result.policy = name
            row = {**summarize(result), "sim_wall_s": round(time.time() - t0, 1), "rollout_s_by_kind": by_kind(result),
                   "overrides": over, "placement": "disaggregated" if vsim.cluster.trainer_gpus else "colocated",
                   "trainer_gpus": vsim.cluster.trainer_gpus, "migrations": sum(r["migrations"] for r in result.rounds),
                   "streamed_tokens": sum(r["streamed_tokens"] for r in result.rounds),
                   "worker_idle_s_by_round": idle_by_round(result)}
            if "speculation" in result.policy_stats:
                row["speculation"] = result.policy_stats["speculation"]
            rows.append(row)
            results.append(result)
            if name == "twotier":
                harvest.append(mean_harvest_prompts(result, run.rollout.n_samples_per_prompt))
            print(f"  {name}: {row['total_s']:.0f} s (simulated in {row['sim_wall_s']} s)", flush=True)
        add_ratios(rows)
        add_best_sync(rows)
        limit = physical_limit(sim, run, speculation=True)
        limit_plain = physical_limit(sim, run, speculation=False)
        add_limit(rows, limit)
        for r in rows:
            key = "any_placement_s_per_sample" if r["placement"] == "disaggregated" else "s_per_sample"
            r["ratio_to_limit_without_speculation"] = r["total_s"] / r["samples"] / limit_plain[key]
            variant = r["policy"].partition("@")[2]
            same = [q["total_s"] for q in rows if q["policy"] == "sync@" + variant and not sync_batch_label(q["policy"])]
            r["throughput_vs_sync_same_mechanisms"] = same[0] / r["total_s"] if same and r["total_s"] else None
        print(f"== {sim.name}  (limit {limit['s_per_sample'] * 1000:.1f} ms/sample with speculation, "
              f"{limit_plain['s_per_sample'] * 1000:.1f} without)")
        print(format_table(rows))
        spec_block = {"config": {k: getattr(sim.speculation, k) for k in sim.speculation.__dataclass_fields__},
                      "calibration": "docs/benchmarks/histospec_sim_calibration.json",
                      "speedup_by_batch": {f"tp{tp}": speedup_by_batch(sim, tp) for tp in
                                           sorted({run.rollout.tensor_parallel_size, run.rollout.long_round_tensor_parallel_size})}}
        if "--no-evidence" not in argv:
            spec_block["long_round_evidence"] = long_round_evidence(sim, run)
        doc = {"scenario": sim.name, "config": path, "rows": rows,
               "limit": {"with_speculation": limit, "without_speculation": limit_plain,
                         "definition": "scheduler/sim/limit.py: max(throughput, longest response alone) + train + sync "
                                       "for the fewest updates; ratio_to_limit uses the bound with speculation (its "
                                       "any-placement form, generation and token training overlapped, for the "
                                       "disaggregated rows)"},
               "speculation": spec_block}
        (out / f"simulation_{scale}.json").write_text(json.dumps(doc, indent=1))
        plot(rows, results, str(out / f"simulation_{scale}.png"), title=sim.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
