"""The tools run's pieces without engines: the tool_multiplication task, its reward, the warm start's rendering of
worked trajectories, and held-out evaluation with tools (megatron_sortedrl/agentic/evaluate.py) against a
hand-made trajectory. CPU; the real tokenizer and chat template of the tiny model, the real hermes parser and the
real tool runner (one spawned worker); the engine is a scripted pool that answers each request with a planned turn.

    PYTHONPATH=$PWD python -m pytest tests/test_tool_multiplication.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sortedrl.agentic.parsers import parse_hermes
from megatron_sortedrl.agentic.trajectory import Trajectories, render_worked
from megatron_sortedrl.config import load_config
from megatron_sortedrl.data import load_prompts
from megatron_sortedrl.data.prompting import PromptEncoder
from megatron_sortedrl.rewards.tool_answer import reward
from megatron_sortedrl.rollout.types import Completion
from megatron_sortedrl.sample import Sample


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tools_cpu.yaml", ["tools.workers=1"])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_sortedrl.tiny_model import _write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    _write_tokenizer_files(d, 1024)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def traj(cfg, tok):
    t = Trajectories.from_config(cfg, tok)  # the real ToolRunner (calculator) in a spawned worker
    yield t
    t.close()


def _run_tools(traj: Trajectories, parsed) -> tuple[list[str], list[str]]:
    traj.runner.submit("k", parsed, {})
    outs = []
    while not outs:
        outs = traj.runner.poll(0.5)
    return outs[0].contents, outs[0].errors


def test_worked_solutions_run_through_the_parser_and_the_calculator(cfg, traj):
    """Each worked trajectory's call, parsed by the hermes parser and run by the real calculator, answers exactly
    the worked tool message, which is the ground truth; the final turn scores 1, a wrong one 0."""
    prompts = load_prompts(cfg.data, "train")[:12]
    assert {p.difficulty for p in prompts} <= {2, 3, 4}
    for p in prompts:
        call, tool, final = p.meta["worked"]
        parsed = parse_hermes(call["content"])
        assert not parsed.error and [c.name for c in parsed.calls] == ["calculator"]
        contents, errors = _run_tools(traj, parsed)
        assert errors == [] and contents == [tool["content"]] == [p.ground_truth]
        s = Sample(p.prompt_id, 0, response_text="ignored", meta={"trajectory": p.meta["worked"]})
        assert reward(s, p.ground_truth) == 1.0
        wrong = {"trajectory": [call, tool, {"role": "assistant", "content": f"#### {int(p.ground_truth) + 1}"}]}
        assert reward(Sample(p.prompt_id, 0, meta=wrong), p.ground_truth) == 0.0
        # the tool's answer in the response is no answer: the final turn must state it
        cut = {"trajectory": [call, tool, {"role": "assistant", "content": "done"}]}
        assert reward(Sample(p.prompt_id, 0, response_text=f"#### {p.ground_truth}", meta=cut), p.ground_truth) == 0


def test_vocabulary_covers_prompts_calls_and_tool_answers(cfg, tok, traj):
    """Every token of a rendered prompt (with the calculator's schema) and of a rendered worked trajectory is a
    real token of the character vocabulary, and decodes back to the same text."""
    enc = PromptEncoder(tok, cfg.data, traj.schemas)
    for p in load_prompts(cfg.data, "eval")[:20]:
        ids = enc.encode(p)
        assert tok.unk_token_id not in ids and len(ids) <= cfg.data.max_prompt_length
        tokens, _ = render_worked(tok, traj.renderer, p.meta["worked"], tok.eos_token_id)
        assert tok.unk_token_id not in tokens
        for m in p.meta["worked"]:
            assert tok.decode(tok.encode(m["content"], add_special_tokens=False)) == m["content"]


def test_tool_schemas_stay_out_of_the_prompt_only_when_asked(cfg, tok, traj):
    """data.tool_schemas_in_prompt=false (the tools run) renders the question alone; true puts the calculator's
    schema into the template's system turn."""
    from dataclasses import replace

    p = load_prompts(cfg.data, "eval")[0]
    short = tok.decode(PromptEncoder(tok, cfg.data, traj.schemas).encode(p))
    assert short == f"<|im_start|>user\n{p.text}<|im_end|>\n<|im_start|>assistant\n"
    full = tok.decode(PromptEncoder(tok, replace(cfg.data, tool_schemas_in_prompt=True), traj.schemas).encode(p))
    assert '"name": "calculator"' in full and full.endswith(short)


def test_warm_start_renders_a_worked_trajectory_as_the_rollout_loop_does(cfg, tok, traj):
    """render_worked (the warm start's targets) equals the trajectory the rollout loop builds from the same turns
    (engine tokens, the real tools' answer rendered by the template, the final turn with its end-of-text), and its
    loss mask is the sample's: 0 exactly on the tool tokens."""
    p = load_prompts(cfg.data, "train")[0]
    call, _, final = p.meta["worked"]
    s = Sample(p.prompt_id, 0, prompt_tokens=[1, 2])
    for text, eos in ((call["content"], []), (final["content"], [tok.eos_token_id])):
        ids = tok.encode(text, add_special_tokens=False) + eos
        c = Completion(s.sample_id, 0, finish_reason="stop")
        c.append(ids, [-0.5] * len(ids), 0)
        c.to_sample(s)
        if traj.turn_done(s):
            (got, more), = _poll(traj)
            assert got is s and more
    tokens, mask = render_worked(tok, traj.renderer, p.meta["worked"], tok.eos_token_id)
    assert s.response_tokens == tokens
    assert s.loss_mask() == [float(m) for m in mask] and 0 < sum(mask) < len(mask)
    assert s.meta["trajectory"] == p.meta["worked"] and s.meta["trajectory_end"] == "answer"


def _poll(traj):
    out = []
    while not out:
        out = traj.poll(0.5)
    return out


class ScriptedPool:
    """The rollout pool's interface (submit_many, poll, in_flight, layout); each request of a sample is answered
    with that sample's next planned turn (token ids), cut to the request's max_tokens."""

    layout = (1, 1)

    def __init__(self, plans: dict[str, list[list[int]]]) -> None:
        self.plans = {k: list(v) for k, v in plans.items()}
        self.requests: list = []
        self._ready: list[Completion] = []

    def submit_many(self, items) -> None:
        for req, _worker in items:
            self.requests.append(req)
            ids = self.plans[req.request_id.split("/")[0]].pop(0)  # request id: the sample id, prompt id first
            ids = ids[:req.sampling["max_tokens"]]
            stop = ids and ids[-1] in req.sampling["stop_token_ids"]
            c = Completion(req.request_id, 0, finish_reason="stop" if stop else "length")
            c.append(ids, [-0.1] * len(ids), 0)
            self._ready.append(c)

    @property
    def in_flight(self) -> int:
        return len(self._ready)

    def poll(self, timeout_s=None):
        out, self._ready = self._ready, []
        return out


def _eval_driver(cfg, tok, traj, plans):
    from megatron_sortedrl.driver import Driver

    enc = PromptEncoder(tok, cfg.data, traj.schemas if traj is not None else None)
    d = SimpleNamespace(cfg=cfg, tok=tok, eos=tok.eos_token_id, agentic=traj, pool=ScriptedPool(plans),
                        _tokens=enc.encode)
    d._sampling = Driver._sampling.__get__(d)
    return d


def test_evaluation_runs_the_turn_loop_with_tools(cfg, tok, traj):
    """Held-out evaluation with tools: a prompt whose greedy turns are the worked trajectory gets the calculator's
    answer appended by the template and is continued (greedy, the budget left) to its final answer, scoring 1;
    one that answers at once and one that calls and then answers wrongly score 0. Without the turn loop (the
    old one-request evaluation) the first stops at its call and scores 0."""
    from megatron_sortedrl.agentic.evaluate import eval_metrics, generate_eval

    p_ok, p_direct, p_wrong = load_prompts(cfg.data, "eval")[:3]

    def ids(text, end=True):
        return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if end else [])

    plans = {p_ok.prompt_id: [ids(p_ok.meta["worked"][0]["content"], False), ids(f"#### {p_ok.ground_truth}")],
             p_direct.prompt_id: [ids("#### 12")],
             p_wrong.prompt_id: [ids(p_wrong.meta["worked"][0]["content"], False), ids("#### 7")]}
    d = _eval_driver(cfg, tok, traj, plans)
    out = {s.prompt_id: s for s in generate_eval(d, [p_ok, p_direct, p_wrong])}
    for s in out.values():
        s.reward = reward(s, s.ground_truth)
    ok = out[p_ok.prompt_id]
    tokens, _ = render_worked(tok, traj.renderer, p_ok.meta["worked"], tok.eos_token_id)
    assert ok.response_tokens == tokens and ok.prompt_tokens == d._tokens(p_ok)
    assert ok.meta["trajectory"] == p_ok.meta["worked"] and ok.turns == 2 and ok.reward == 1.0
    # the continued request: prompt + everything so far, greedy, the budget left
    second = [r for r in d.pool.requests if r.request_id == ok.sample_id][1]
    first_len = len(ids(p_ok.meta["worked"][0]["content"], False))
    assert second.prompt_tokens == ok.prompt_tokens + ok.response_tokens[:ok.tool_spans[0][1]]
    assert second.sampling["temperature"] == 0.0 and first_len < ok.tool_spans[0][1]
    assert second.sampling["max_tokens"] == cfg.rollout.max_response_length - ok.tool_spans[0][1]
    assert out[p_direct.prompt_id].reward == 0.0 and out[p_direct.prompt_id].turns == 1
    assert out[p_wrong.prompt_id].reward == 0.0 and out[p_wrong.prompt_id].meta["tool_calls"] == 1
    m = eval_metrics(list(out.values()), with_tools=True)
    assert m["eval/accuracy"] == pytest.approx(1 / 3) and m["eval/tools/calls"] == 2.0
    assert m["eval/tools/calling_share"] == pytest.approx(2 / 3)
    assert m["eval/tools/turns_per_trajectory"] == pytest.approx(5 / 3) and m["eval/tools/errors"] == 0.0
    # the broken variant: one request per prompt stops at the call
    plain = _eval_driver(cfg, tok, None, {p_ok.prompt_id: plans[p_ok.prompt_id][:1]})
    plain._sampling = lambda n, greedy=False: {"max_tokens": n, "temperature": 0.0,
                                               "stop_token_ids": [tok.eos_token_id] + traj.stop_token_ids}
    (s,) = generate_eval(plain, [p_ok])
    assert reward(s, s.ground_truth) == 0.0 and s.response_text.rstrip().endswith("</tool_call>")


@pytest.mark.slow
def test_tools_run_trains_with_tool_calls_end_to_end(tmp_path):
    """`train configs/tools_cpu.yaml`, shortened (a warm start on worked trajectories only, two RL steps): it runs
    to the end, the trajectories call the calculator (tools/calls > 0 in every step), no metric is NaN, and the
    held-out evaluation before and after RL ran with tools. Real tiny model, Megatron trainer, vLLM engine, Ray.
        RAY_TMPDIR=/tmp/x PYTHONPATH=$PWD python -m pytest tests/test_tool_multiplication.py -q -m slow"""
    import json
    import math
    import subprocess
    import sys

    args = [f"model.path={tmp_path / 'model'}", f"logging.run_dir={tmp_path / 'run'}", "trainer.total_steps=2",
            "trainer.warmup_sft_steps=40", "trainer.warmup_answer_only_share=0", "trainer.warmup_sft_problems=256",
            "data.num_train_prompts=16", "data.num_eval_prompts=4", "logging.tensorboard=false",
            "scheduler.rollout_batch_size=4", "scheduler.update_batch_size=8", "scheduler.group_size=8"]
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tools_cpu.yaml", *args],
                              stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, log.read_text()[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "tools/calls" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["tools/calls"] > 0 and r["tools/turns_per_trajectory"] >= 1 for r in steps)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2] and all("eval/tools/calls" in r for r in evals)
    for r in rows:
        for k, v in r.items():
            assert not (isinstance(v, float) and math.isnan(v)), (r["step"], k)
    for k in ("train/loss", "train/grad_norm"):
        assert all(k in r and math.isfinite(r[k]) for r in steps)
