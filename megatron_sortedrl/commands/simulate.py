"""`python -m megatron_sortedrl simulate <sim.yaml> [key=value ...] --policies sync,sorted,tail,twotier`

Runs the real scheduling policies on the discrete-event cluster simulator (`scheduler/sim/simulator.py`),
prints a table (bubble ratios, rollout and step time, throughput and its ratio to sync, to the best sync at equal
optimizer steps and to the scenario's physical limit, optimizer steps and samples per step, staleness) and writes a
plot and a JSON of the figures. With `sync` and another policy among `--policies`, `sync` runs again at a rollout
batch equal to the default policy's mean harvest (`sync@<B>`), and `x best sync` is each row's throughput over the
better plain sync (`scheduler/sim/equal_footing.py`); every policy trains `run.algorithm.ppo_mini_batch_size` samples
per optimizer step. Overrides starting with `run.` change
the run config the scenario points to (e.g. `run.scheduler.max_staleness=2`), others the scenario
(e.g. `workload.persistence=0.5`). Timelines per policy are written with `--timelines DIR`.

`--calibrate-from RUN_DIR` (or the scenario key `calibrate_from`) replaces the scenario's engine and cluster
costs by those measured on a real run (decode step time against batch and context, prefill, train time
per token and fixed, weight sync, reward latency; `scheduler/sim/calibrate.py`), replays that run's response
lengths and simulates with that run's own config; the engine speed is level-matched (one factor on all
engines so that the run's own replay spends its measured rollout seconds; `--no-level-match` keeps the raw
fit); the measured costs are printed and written to `calibration.json`. Example:

    python -m megatron_sortedrl simulate configs/sim_tiny_cpu.yaml --calibrate-from runs/tiny_cpu --policies sync

Left out: sweeps (call it in a loop, or see benchmarks/simulate_policies.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_sortedrl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="simulator scenario YAML, e.g. configs/sim_tiny_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (run.* for the run config)")
    parser.add_argument("--policies", default="sync,sorted,tail,twotier",
                        help="comma-separated tier-1 policies, each optionally with +histospec (speculation model)")
    parser.add_argument("--out", default="runs/simulate", help="directory for simulation.json and simulation.png")
    parser.add_argument("--timelines", default="", help="also write each policy's timeline JSONL into this directory")
    parser.add_argument("--calibrate-from", default="", metavar="RUN_DIR",
                        help="measure costs on this `train` run directory and replay its response lengths "
                             "(its config.yaml becomes the run config; run.* overrides still apply)")
    parser.add_argument("--no-level-match", action="store_true",
                        help="with --calibrate-from: keep the decode fit's engine speed as fitted instead of scaling "
                             "it so that the run's replay spends the run's measured rollout seconds")


def run(args: argparse.Namespace) -> int:
    from scheduler.policies import POLICIES
    from scheduler.sim.report import add_ratios, format_table, plot
    from scheduler.sim.sim_config import load_sim_config
    from scheduler.sim.async_sim import ASYNC_POLICIES, parse_label, simulate_any as simulate

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    from scheduler.sim.speculation_model import split_policy

    bad = [p for p in names if split_policy(p)[0] not in POLICIES and parse_label(p) is None]
    if bad or not names:
        raise UserError(f"--policies: unknown {bad or 'empty list'}; choose from {', '.join(POLICIES)} or the "
                        f"asynchronous {', '.join(ASYNC_POLICIES)}[@t<trainer GPUs>s<bound>k<steps per push>] "
                        "(each optionally with +histospec)")
    sim, run_cfg = load_sim_config(args.config, args.overrides)
    out = Path(args.out)
    run_dir = getattr(args, "calibrate_from", "") or sim.calibrate_from
    if run_dir:
        from scheduler.sim.calibrate import calibrated_scenario, describe

        run_over = [o[len("run."):] for o in args.overrides if o.startswith("run.")]
        sim, run_cfg, cal = calibrated_scenario(sim, run_dir, out, run_over,
                                                match_level=not getattr(args, "no_level_match", False))
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(
            {"run_dir": str(run_dir), "engine": cal.engine, "cluster": cal.cluster, "fit": cal.fit}, indent=1))
        print(describe(cal, run_dir))
    from scheduler.sim.equal_footing import compare

    def written(name, result, row):  # (compare() records each row's sim_wall_s)
        if args.timelines:
            from megatron_sortedrl.telemetry.timeline import TimelineWriter

            Path(args.timelines).mkdir(parents=True, exist_ok=True)
            with TimelineWriter(Path(args.timelines) / f"timeline.{name}.jsonl") as w:
                for e in result.events:
                    w.write(e)

    rows, results = compare(sim, run_cfg, names, simulate, written)  # + sync@<default's harvest>, x_best_sync
    add_ratios(rows)
    from scheduler.sim.limit import add_limit, physical_limit

    limit = physical_limit(sim, run_cfg)
    add_limit(rows, limit)  # "x limit": time per trained sample over the scenario's physical limit
    print(f"{sim.name}: {sim.workload.num_prompts} prompts x {run_cfg.rollout.n_samples_per_prompt} x "
          f"{sim.workload.num_epochs} epochs on {sim.cluster.gpus} GPUs")
    print(format_table(rows))
    out.mkdir(parents=True, exist_ok=True)
    print(f"physical limit: {limit['s_per_sample'] * 1000:.1f} ms per trained sample ({limit['rollout_bound']} bound)")
    (out / "simulation.json").write_text(json.dumps({"scenario": sim.name, "rows": rows, "limit": limit}, indent=1))
    plot(rows, results, str(out / "simulation.png"), title=sim.name)
    print(f"wrote {out / 'simulation.json'} and {out / 'simulation.png'}")
    return 0
