"""Trajectory records (megatron_sortedrl/agentic/trajectory.py) against what the engine generated and what the chat
template rendered: a hypothesis property over random turn structures, and the pieces it relies on. CPU, no engine
(turns come as real `Completion` records from a scripted engine), the tiny model's real tokenizer and template.

    PYTHONPATH=$PWD python -m pytest tests/test_trajectory.py -q
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_sortedrl.agentic.trajectory import PLACEHOLDER_LOGPROB, Trajectories, step_metrics
from megatron_sortedrl.rollout.types import Completion
from megatron_sortedrl.sample import Sample
from tests import agentic_stub as stub


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_sortedrl.tiny_model import _write_tokenizer_files

    d = tmp_path_factory.mktemp("tok")
    _write_tokenizer_files(d, 1024)
    return AutoTokenizer.from_pretrained(d)


def _traj(tok, runner, max_turns=4, max_len=400):
    return Trajectories(tok, runner, stub.hermes, stub.HERMES_STOP, max_turns, max_len)


def _prompt(tok, text="What is 12*7?"):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


# One planned assistant turn: free text, then either a call (good, unknown tool, malformed JSON) or a final answer.
# free text of printable ASCII without "<", so it never spells a special or tool token by chance
_chars = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126, blacklist_characters="<"), max_size=12)
_turn = st.tuples(_chars, st.sampled_from(["call", "unknown", "malformed", "final"]),
                  st.integers(0, 99), st.integers(0, 99))


def _turn_text(free: str, kind: str, a: int, b: int) -> tuple[str, bool]:
    if kind == "final":
        return f"{free} answer {a * b}", True
    if kind == "malformed":
        return f"{free}<tool_call>{{\"name\": calc</tool_call>", False
    name = "calculator" if kind == "call" else "search"
    return f"{free}<tool_call>{json.dumps({'name': name, 'arguments': {'expr': f'{a}*{b}'}})}</tool_call>", False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(_turn, min_size=1, max_size=5), seed=st.integers(0, 2**16), max_turns=st.integers(1, 5),
       max_len=st.integers(20, 400))
def test_trajectory_lines_up_with_engine_and_template(tok, turns, seed, max_turns, max_len):
    """Random turns, tool outputs and errors, version changes between and inside turns, aborts in the middle of a
    turn and while waiting for tools: the response is exactly the engine's tokens and the template's tool tokens,
    the loss mask is 0 exactly on tool tokens, log-probs and versions are the engine's on generated tokens, and
    prompt + response decode to the template's rendering of the conversation."""
    rng = random.Random(seed)
    runner = stub.ToolRunner()
    traj = _traj(tok, runner, max_turns, max_len)
    s = Sample("p0", 0, prompt_tokens=_prompt(tok))
    expect: list[tuple[int, bool, float, int]] = []  # (token, generated, log-prob, version)
    messages = [{"role": "user", "content": "What is 12*7?"}]
    version, done = 0, False
    for free, kind, a, b in turns:
        text, final = _turn_text(free, kind, a, b)
        ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if final else [])
        budget = max_len - s.response_length
        ids, cut = ids[:budget], len(ids) > budget
        # the engine delivers the turn in pieces: aborts (partials resumed later) and weight syncs in between
        pos = 0
        while True:
            n = rng.randint(0, len(ids) - pos)
            c = Completion(s.sample_id, 0)
            piece = ids[pos:pos + n] if pos + n < len(ids) else ids[pos:]
            for j in range(0, len(piece), 3):  # a version change while paused inside one request
                if rng.random() < 0.2:
                    version += 1
                lps = [-rng.random() * 5 for _ in piece[j:j + 3]]
                c.append(piece[j:j + 3], lps, version)
                expect += [(t, True, lp, version) for t, lp in zip(piece[j:j + 3], lps)]
            pos += len(piece)
            c.finish_reason = "abort" if pos < len(ids) else ("length" if cut else "stop")
            c.to_sample(s)
            if c.finished:
                break
            if rng.random() < 0.5:
                version += 1
        messages.append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
        if not traj.turn_done(s):
            done = True
            break
        if rng.random() < 0.3:  # aborted while its tool ran: a partial that re-runs the calls when resumed
            assert traj.drop(s.sample_id) is s and s.finish_reason == "abort"
            assert traj.resume(s)
        (got, cont), = traj.poll()
        assert got is s and not traj.waiting
        if not cont:
            done = True
            break
        k = _last_tool_count(s)
        want = {"call": [str(a * b)], "unknown": ["error: unknown tool search"],
                "malformed": [stub.hermes(text).error]}[kind]
        assert [m["content"] for m in s.meta["trajectory"][-k:]] == want  # the calls' answers, in order
        rendered = tok.encode(traj.renderer.text(want), add_special_tokens=False)
        start, end = s.tool_spans[-1]
        assert s.response_tokens[start:end] == rendered and start == len(expect)
        expect += [(t, False, PLACEHOLDER_LOGPROB, None) for t in rendered]
        messages += s.meta["trajectory"][-k:]
    # exactly the engine's tokens and the template's
    assert s.response_tokens == [t for t, *_ in expect]
    mask = s.loss_mask() or [1.0] * s.response_length
    assert mask == [1.0 if g else 0.0 for _, g, _, _ in expect]
    assert s.rollout_logprobs == [lp for _, _, lp, _ in expect]
    versions = s.token_versions()
    assert [v for v, (_, g, _, _) in zip(versions, expect) if g] == [v for _, g, _, v in expect if g]
    assert s.response_length <= max_len and s.turns <= max_turns
    if done:
        assert s.meta["trajectory_end"] in ("answer", "length", "max_turns")
        assert [m["role"] for m in s.meta["trajectory"]] == [m["role"] for m in messages[1:]]
    # prompt + response is the template's rendering of the conversation, up to where the response stops
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not done)  # not done: next header
    text = tok.decode(s.prompt_tokens + s.response_tokens, skip_special_tokens=False)
    text = text.removesuffix(tok.eos_token)
    if done and s.meta["trajectory_end"] == "answer":
        assert full == text + "<|im_end|>\n"
    else:
        assert full.startswith(text), (full, text)


def _last_tool_count(s: Sample) -> int:
    n = 0
    for m in reversed(s.meta["trajectory"]):
        if m["role"] != "tool":
            break
        n += 1
    return n


def _call_turn(tok, expr="2*3"):
    return tok.encode(f'<tool_call>{{"name": "calculator", "arguments": {{"expr": "{expr}"}}}}</tool_call>',
                      add_special_tokens=False)


def _finish(s, ids, version=0, reason="stop"):
    c = Completion(s.sample_id, 0)
    c.append(ids, [-0.5] * len(ids), version)
    c.finish_reason = reason
    c.to_sample(s)


def test_max_turns_ends_a_calling_trajectory_and_metrics_count_it(tok):
    traj = _traj(tok, stub.ToolRunner(), max_turns=2)
    s = Sample("p0", 0, prompt_tokens=_prompt(tok))
    _finish(s, _call_turn(tok))
    assert traj.turn_done(s) and s.meta["awaiting_tools"]
    (got, more), = traj.poll()
    assert more and s.meta["tool_state"] == {"calls": 1} and not s.meta["awaiting_tools"]
    _finish(s, _call_turn(tok, "4*5"), version=1)
    assert not traj.turn_done(s) and s.meta["trajectory_end"] == "max_turns"  # the call is not run
    assert [m["role"] for m in s.meta["trajectory"]] == ["assistant", "tool", "assistant"]
    m = step_metrics([s, Sample("p1", 0)])
    assert m["tools/calls"] == 1 and m["tools/turns_per_trajectory"] == 1.0 and m["tools/calling_share"] == 0.5
    # checkpointable: a round trip keeps spans, turns and tool state; an on-policy restart drops all of it
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.tool_spans == s.tool_spans and back.turns == 2 and back.loss_mask() == s.loss_mask()
    back.reset_response()
    assert (back.tool_spans, back.turns, back.loss_mask()) == ([], 0, None) and "tool_state" not in back.meta


def test_late_outcome_of_an_aborted_call_is_ignored_and_errors_are_counted(tok):
    runner = stub.ToolRunner()
    traj = _traj(tok, runner)
    s = Sample("p0", 0, prompt_tokens=_prompt(tok))
    _finish(s, tok.encode('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', add_special_tokens=False))
    assert traj.turn_done(s)
    assert traj.drop(s.sample_id) is s and traj.drop(s.sample_id) is None  # a partial now; its outcome is stale
    assert traj.poll() == [] and s.meta["awaiting_tools"]  # the stale outcome lands and is ignored
    assert traj.resume(s) and len(runner.submitted) == 2  # resumed: the call runs again
    (got, more), = traj.poll()
    assert more and s.meta["tool_errors"] == 1 and s.meta["tool_error_kinds"] == {"unknown_tool": 1}
    assert step_metrics([s])["tools/errors_unknown_tool"] == 1


def test_tool_answer_past_the_budget_ends_the_trajectory(tok):
    traj = _traj(tok, stub.ToolRunner(), max_len=len(_call_turn(tok)) + 5)
    s = Sample("p0", 0, prompt_tokens=_prompt(tok))
    _finish(s, _call_turn(tok))
    assert traj.turn_done(s)
    (got, more), = traj.poll()
    assert not more and s.finish_reason == "length" and s.tool_spans == [] and s.meta["trajectory_end"] == "length"


def test_stop_string_must_be_one_token(tok):
    from megatron_sortedrl.errors import ConfigError

    with pytest.raises(ConfigError, match="tools.parser"):
        Trajectories(tok, stub.ToolRunner(), stub.hermes, "</call>", 4, 100)


def test_tiny_vocabulary_covers_template_and_tool_schemas(tok):
    """The character vocabulary renders the template with tools and tool messages without an unknown token."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "7"}],
        tools=stub.ToolRunner().schemas(), tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids and tok.decode(ids) == text


def test_rows_with_tools_load(tmp_path):
    from megatron_sortedrl.data.loaders import load_files
    from megatron_sortedrl.errors import DatasetError

    rows = [{"prompt": [{"role": "user", "content": "12*7?"}], "reward_model": {"ground_truth": "84"},
             "extra_info": {"index": 3, "tools_kwargs": {"calculator": {"create_kwargs": {"precision": 0}}}}},
            {"prompt": "2+2?", "answer": "4", "tools": ["calculator", {"type": "function",
                                                                       "function": {"name": "python"}}]}]
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    a, b = load_files([str(f)], "prompt", "answer")
    assert a.meta["tools_kwargs"] == {"calculator": {"create_kwargs": {"precision": 0}}} and "tools" not in a.meta
    assert b.meta["tools"] == ["calculator", "python"]
    from megatron_sortedrl.agentic.trajectory import initial_state, sample_meta

    assert initial_state(Sample("x", 0, meta=sample_meta(a))) == {"tools_kwargs": a.meta["tools_kwargs"]}
    f.write_text(json.dumps({"prompt": "x", "answer": "1", "tools": "calculator"}))
    with pytest.raises(DatasetError, match="t.jsonl:1.*'tools' is a str"):
        load_files([str(f)], "prompt", "answer")


def test_prompt_encoder_renders_the_rows_tools(tok):
    from types import SimpleNamespace

    from megatron_sortedrl.data.prompting import PromptEncoder
    from megatron_sortedrl.sample import Prompt

    runner = stub.ToolRunner({"calculator": stub.calculator, "python": stub.calculator})
    data = SimpleNamespace(apply_chat_template=True, max_prompt_length=4096, tool_schemas_in_prompt=True)
    enc = PromptEncoder(tok, data, runner.schemas)
    both = tok.decode(enc.encode(Prompt("a", "2+2?", "4")))
    one = tok.decode(enc.encode(Prompt("b", "2+2?", "4", meta={"tools": ["python"]})))
    assert '"name": "calculator"' in both and '"name": "python"' in both
    assert '"name": "calculator"' not in one and '"name": "python"' in one and "# Tools" in one


def test_tools_need_the_chat_template_and_none_builds_nothing(tok):
    from megatron_sortedrl.agentic.trajectory import trajectories_for
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.errors import ConfigError

    cfg = RunConfig()
    assert trajectories_for(cfg, tok) is None  # tools off: one response per sample, as before
    cfg.tools.tools = ["calculator"]
    with pytest.raises(ConfigError, match="data.apply_chat_template"):
        trajectories_for(cfg, tok, runner=stub.ToolRunner())


def test_trainer_items_mask_tool_tokens_on_top_of_overlong_masking(tok):
    """What the trainer group sends its ranks: the per-token mask is 0 on tool spans (and all 0 for an overlong-
    masked sample), behaviour log-probs ride along; advantages' token weights count generated tokens only."""
    from types import SimpleNamespace

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.group import TrainerGroup

    traj = _traj(tok, stub.ToolRunner())
    s = Sample("p0", 0, prompt_tokens=_prompt(tok), reward=1.0)
    _finish(s, _call_turn(tok))
    traj.turn_done(s)
    traj.poll()
    _finish(s, tok.encode("6", add_special_tokens=False) + [tok.eos_token_id])
    plain = Sample("p0", 1, prompt_tokens=[5, 6], response_tokens=[7, 8], rollout_logprobs=[-1.0, -1.0], reward=0.0)
    masked = Sample("p0", 2, prompt_tokens=[5], response_tokens=[7], rollout_logprobs=[-1.0], reward=0.0,
                    tool_spans=[], meta={"loss_masked": True})
    group = SimpleNamespace(cfg=RunConfig())
    group.advantages, group._item = (lambda batch: TrainerGroup.advantages(group, batch)), TrainerGroup._item
    items = TrainerGroup._rl_items(group, [s, plain, masked], [1.0, 0.0, 0.0], None)
    start, end = s.tool_spans[0]
    assert items[0]["mask"] == [1.0] * start + [0.0] * (end - start) + [1.0] * (s.response_length - end)
    assert items[1]["mask"] is None and items[2]["mask"] == [0.0]
    assert items[0]["extras"]["rollout_logprobs"] == s.rollout_logprobs


def test_the_scheduler_history_records_trajectory_cost_from_the_samples(tok):
    """The driver attaches its trajectories to the policy: the history records each finished trajectory's turns
    and tool seconds (not its tokens alone), and a step's decode rate prices a tool second in tokens."""
    from scheduler.config import SchedulerConfig
    from scheduler.layout import FixedPlanner
    from scheduler.policies import make_policy

    policy = make_policy(SchedulerConfig(), ["p"], n_samples=1, max_response_length=64,
                         planner=FixedPlanner(gpus=1, gpus_per_node=1, tp_short=1, tp_long=1))
    traj = Trajectories(tok, stub.ToolRunner(), stub.hermes, stub.HERMES_STOP, 4, 64)
    traj.attach(policy)
    s = Sample("p", 0, prompt_tokens=[5, 6], response_tokens=list(range(10, 40)), tool_spans=[(10, 20)], turns=2,
               submit_time=1.0, finish_time=6.0, meta={"tool_seconds": 3.0})
    assert policy.trajectory_info(s) == (2, 3.0)
    traj.observe([s])  # 20 generated tokens in 5 - 3 = 2 engine seconds
    assert policy.tokens_per_tool_s == 10.0
    policy.history.record("p", 0, s.response_length, turns=2, tool_s=3.0)
    assert policy.history.predict_cost("p", policy.tokens_per_tool_s) == s.response_length + 10.0 * 3.0
