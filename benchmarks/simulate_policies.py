"""Simulation benchmark: every tier-1 policy on two scales, figures committed to docs/benchmarks/.

    .venv/bin/python benchmarks/simulate_policies.py            # about two minutes on 2 CPU cores

Scales: the 2-core CPU default (configs/sim_tiny_cpu.yaml) and Qwen2.5-32B on 128 GPUs with 32k-token
tails (configs/sim_qwen32b_128gpu.yaml). Writes docs/benchmarks/simulation_<scale>.json (one row per
policy, ratios against sync from the same run) and simulation_<scale>.png.

Left out: accuracy effects of the policies (the simulator has no model).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler.report import add_ratios, format_table, plot, summarize  # noqa: E402
from scheduler.sim_config import load_sim_config  # noqa: E402
from scheduler.simulator import simulate  # noqa: E402

SCALES = {"tiny_cpu": "configs/sim_tiny_cpu.yaml", "qwen32b_128gpu": "configs/sim_qwen32b_128gpu.yaml"}
POLICIES = ("sync", "sorted", "tail", "twotier")


def main() -> int:
    out = ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    for scale, path in SCALES.items():
        sim, run = load_sim_config(ROOT / path)
        rows, results = [], []
        for name in POLICIES:
            t0 = time.time()
            result = simulate(sim, run, name)
            rows.append({**summarize(result), "sim_wall_s": round(time.time() - t0, 1)})
            results.append(result)
        add_ratios(rows)
        print(f"== {sim.name}")
        print(format_table(rows))
        (out / f"simulation_{scale}.json").write_text(json.dumps({"scenario": sim.name, "config": path, "rows": rows}, indent=1))
        plot(rows, results, str(out / f"simulation_{scale}.png"), title=sim.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
