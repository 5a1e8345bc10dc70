"""Trajectories: one `Sample` whose response is assistant turns and tool messages, in order (docs/agentic.md).

    traj = Trajectories.from_config(cfg, tokenizer)        # None-free: only built when cfg.tools.tools is set
    sampling["stop_token_ids"] += traj.stop_token_ids      # a turn that calls a tool ends on </tool_call>
    # in the rollout loop (round_stream.py):
    traj.turn_done(s)   -> True: the sample waits for its tools (do not score it); False: final, score it
    traj.poll()         -> [(sample, continues)]: tool answers appended; continues -> queue it, else score it
    traj.resume(s)      -> True when a carried-over sample still needed its tools (they were re-run)
    traj.drop(sid)      -> the sample if it was waiting for tools (an abort: its late outcome is ignored)

The record: `response_tokens` are the engine's tokens of every assistant turn exactly as generated, and between
two turns the chat template's rendering of the tool messages and of the next assistant header, tokenised on
its own (`ToolRenderer`: the difference of the template applied with and without the tool messages, as text).
Generated text is never re-tokenised. `Sample.tool_spans` are the response-token ranges that came from tools:
their log-probs are placeholders (0.0) and the trainer masks them (`Sample.loss_mask`); generated tokens keep
their per-token log-probs and version spans (a tool span takes the version of the turn before it, opening no
span). `Sample.turns` counts assistant turns; `meta` holds the per-trajectory tool state (`tool_state`, JSON),
tool counts and seconds, and at the end `trajectory`: the messages ({"role": "assistant" | "tool",
"content"}) that reward functions can read beside `response_text`.

A trajectory ends on a turn without a call (a final answer), on the turn that reaches `tools.max_turns`, or when
the whole response reaches `rollout.max_response_length` (an engine turn cut by length, or a tool answer that
would not leave room for one more generated token: it is then not appended and the trajectory ends "length").

Interruptions are at token granularity as for one-response samples: an aborted turn is a partial whose tokens
are kept and continued. A sample waiting for its tools when it is aborted (harvest, carry-over) is handed back
as a partial with `meta["awaiting_tools"]`; the outcome of the call in flight is ignored (each submission has
its own key) and the calls are re-run, from the same state, when the sample is resumed. Tools should therefore
not keep side effects outside the state; the re-run costs one more tool call, never a lost trajectory.

Left out: tool calls that run while the engine keeps generating (a turn ends at its first </tool_call>), stop
strings of several tokens (the engines run without a tokenizer: the parser's stop must be one token, as Qwen's
</tool_call> is). HistoSpec drafts a trajectory's turn k from the previous epoch's turn k of the same prompt
(docs/speculative.md, "Trajectories"; `ToolRenderer.turn_marker` tells the drafters where turns start).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.sample import Sample

PLACEHOLDER_LOGPROB = 0.0  # log-prob stored for tool tokens: finite (a masked term must not be 0 * inf = nan)
_SENTINEL = "\u2063MSRL-TURN\u2063"  # an assistant text no template rewrites; marks where a turn's text ends


class ToolRenderer:
    """Token ids of tool messages as the chat template renders them after an assistant turn that called tools:
    the template's end of that turn, the tool messages, and the next assistant header."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        self.tok, self.tools = tokenizer, tools or None
        self._probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
        closed = self._render(self._probe, generation=False)
        if _SENTINEL not in closed:
            raise ConfigError("tools.tools", "(chat template)", "a model whose chat template renders assistant "
                              "messages' content (the tokenizer's template dropped it)")
        self._base = closed
        self._close = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]  # e.g. "<|im_end|>\n"

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=generation)

    def text(self, contents: list[str]) -> str:
        """The text between an assistant turn that ended on its tool call and the next assistant turn."""
        full = self._render(self._probe + [{"role": "tool", "content": c} for c in contents], generation=True)
        if not full.startswith(self._base):  # the template rewrote earlier turns once tools followed
            raise ConfigError("tools.tools", "(chat template)", "a chat template that renders a tool message after "
                              "the assistant turn without changing what came before (Qwen/Hermes style)")
        return self._close + full[len(self._base):]

    def tokens(self, contents: list[str]) -> list[int]:
        return list(self.tok.encode(self.text(contents), add_special_tokens=False))

    def turn_marker(self) -> list[int]:
        """Token ids that end every rendering of tool messages: the template's header of the next assistant turn.
        HistoSpec counts them after the prompt to tell which turn a continued request generates
        (docs/speculative.md, "Trajectories"); [] when the template's header cannot be told apart."""
        done = self._render(self._probe + [{"role": "tool", "content": "?"}], generation=False)
        full = self._render(self._probe + [{"role": "tool", "content": "?"}], generation=True)
        if not full.startswith(done) or len(full) == len(done):
            return []
        marker = list(self.tok.encode(full[len(done):], add_special_tokens=False))
        # Tokenised alone it must be what every rendering ends with (a BPE merge across the boundary would not be).
        ends = all(t[-len(marker):] == marker for t in (self.tokens(["0"]), self.tokens(["a b"])))
        return marker if ends else []


def stop_token_id(tokenizer: Any, stop: str) -> int:
    """The one token id of the parser's stop string (the engines stop on token ids, not strings)."""
    ids = list(tokenizer.encode(stop, add_special_tokens=False))
    if len(ids) != 1:
        raise ConfigError("tools.parser", stop, f"a parser whose stop string is one token of this tokenizer ({stop!r} "
                          f"is {len(ids)} tokens; Qwen2.5/Qwen3 and the built-in tiny model have </tool_call> as one)")
    return ids[0]


class Trajectories:
    """The turn loop of tool-using samples, between the rollout pool and a `ToolRunner` (never blocking)."""

    def __init__(self, tokenizer: Any, runner: Any, parser: Callable[[str], Any], stop: str, max_turns: int,
                 max_response_length: int, renderer: ToolRenderer | None = None,
                 record: Callable[[str, Sample], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.tok, self.runner, self.parser = tokenizer, runner, parser
        self.stop_id = stop_token_id(tokenizer, stop)
        self.max_turns, self.max_len = int(max_turns), int(max_response_length)
        self.renderer = renderer or ToolRenderer(tokenizer)
        self.record = record or (lambda event, s: None)  # timeline hook: ("tool_call" | "tool_result", sample)
        self.clock = clock
        self.waiting: dict[str, Sample] = {}  # submission key -> sample waiting for its tools
        self._serial = 0

    @classmethod
    def from_config(cls, cfg, tokenizer: Any, runner: Any = None, **kw: Any) -> Trajectories:
        """From the run config; `runner` (tests) replaces `ToolRunner.from_config(cfg)`."""
        from megatron_sortedrl.agentic.parsers import HERMES_STOP, parser_from

        if runner is None:
            from megatron_sortedrl.agentic.runner import ToolRunner

            runner = ToolRunner.from_config(cfg)
        parser = parser_from(cfg.tools.parser)
        stop = HERMES_STOP if cfg.tools.parser == "hermes" else getattr(parser, "stop", HERMES_STOP)
        return cls(tokenizer, runner, parser, stop, cfg.tools.max_turns, cfg.rollout.max_response_length, **kw)

    def attach(self, policy: Any) -> None:
        """Lets the scheduler's history predict each prompt's trajectory cost (tokens, turns, tool seconds:
        `scheduler/base.py`, `scheduler/history.py`), as the simulator does, from the samples' own records."""
        policy.trajectory_info = trajectory_info
        self.policy = policy

    def observe(self, batch: list[Sample]) -> None:
        """Gives the policy this step's tokens per tool second: the median decode rate of one trajectory, its
        generated tokens over its time with the engines (first submit to finish, tool waits excluded; queueing
        counts, so it is a lower bound of the engine's rate). A tool second costs that many tokens of a turn."""
        rates = []
        for s in batch:
            busy = s.finish_time - s.submit_time - float(s.meta.get("tool_seconds", 0.0))
            if s.generated_length and busy > 0:
                rates.append(s.generated_length / busy)
        if rates and getattr(self, "policy", None) is not None:
            self.policy.tokens_per_tool_s = statistics.median(rates)

    def schemas(self, names: list[str] | None = None) -> list[dict]:
        """The tools' OpenAI-style schemas (a data row's own tool list narrows them), for the prompt's template."""
        return self.runner.schemas(names)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.stop_id]

    @property
    def num_waiting(self) -> int:
        """Samples waiting for their tools. (Not `__len__`: the driver asks `is not None`, and a length made an
        idle loop read as no tools at all.)"""
        return len(self.waiting)

    # ------------------------------------------------------------------------------------------ turns
    @staticmethod
    def turn_start(s: Sample) -> int:
        """Response index where the current (last) assistant turn starts."""
        return s.tool_spans[-1][1] if s.tool_spans else 0

    def turn_done(self, s: Sample) -> bool:
        """`s` just finished an engine request (stop or length). True: its calls went to the tools and it stays
        in flight; False: the trajectory is complete (`meta["trajectory"]` filled) and goes to the reward."""
        s.turns += 1
        turn = s.response_tokens[self.turn_start(s):]
        parsed = None
        if s.finish_reason == "stop" and turn and turn[-1] == self.stop_id:
            parsed = self.parser(self._decode(turn))
        if parsed is None or not (parsed.calls or parsed.error):
            return self._final(s, "answer" if s.finish_reason == "stop" else "length")
        if s.turns >= self.max_turns:
            return self._final(s, "max_turns")
        if s.response_length >= self.max_len:
            return self._final(s, "length")
        self._submit(s, parsed)
        return True

    def resume(self, s: Sample) -> bool:
        """A sample taken from a queue: if it was waiting for its tools when aborted, re-run them (True)."""
        if not s.meta.get("awaiting_tools"):
            return False
        self._submit(s, self.parser(self._decode(s.response_tokens[self.turn_start(s):])))
        return True

    def drop(self, sample_id: str) -> Sample | None:
        """An abort of `sample_id`: the sample if it was waiting for tools (kept as a partial that re-runs
        them when resumed, `resume`), else None (it is the pool's or a queue's)."""
        key = next((k for k, s in self.waiting.items() if s.sample_id == sample_id), None)
        if key is None:
            return None
        s = self.waiting.pop(key)
        s.finish_reason = "abort"
        return s

    def drop_all(self) -> list[Sample]:
        """Every sample still waiting for tools, handed back as partials (the end of a round)."""
        return [s for s in (self.drop(s.sample_id) for s in list(self.waiting.values())) if s is not None]

    def poll(self, timeout_s: float = 0.0) -> list[tuple[Sample, bool]]:
        """Tool outcomes that landed, applied: (sample, True) continues with its next turn (queue it as a
        continued request), (sample, False) is complete (score it)."""
        out = []
        for o in self.runner.poll(timeout_s):
            s = self.waiting.pop(o.key, None)
            if s is None:
                continue  # the sample was aborted meanwhile; its calls re-run when it resumes
            out.append((s, self.apply(s, o.contents, o.state, o.seconds, o.errors)))
        return out

    def apply(self, s: Sample, contents: list[str], state: dict, seconds: float = 0.0,
              errors: list[str] | None = None) -> bool:
        """Appends the rendered tool messages to `s` (True), or ends it when they would not leave room for one
        more generated token (False, "length")."""
        m = s.meta
        m["tool_state"], m["awaiting_tools"] = state, False
        m["tool_calls"] = m.get("tool_calls", 0) + len(contents)
        m["tool_errors"] = m.get("tool_errors", 0) + len(errors or [])
        m["tool_seconds"] = m.get("tool_seconds", 0.0) + float(seconds)
        for kind in errors or []:
            m.setdefault("tool_error_kinds", {})[kind] = m.get("tool_error_kinds", {}).get(kind, 0) + 1
        self.record("tool_result", s)
        start = self.turn_start(s)
        m.setdefault("trajectory", []).append({"role": "assistant", "content": self._decode(s.response_tokens[start:])})
        tokens = self.renderer.tokens(contents)
        if s.response_length + len(tokens) >= self.max_len:
            s.finish_reason = "length"
            m["trajectory_end"] = "length"
            return False
        m["trajectory"].extend({"role": "tool", "content": c} for c in contents)
        n = s.response_length
        s.response_tokens.extend(tokens)
        s.rollout_logprobs.extend([PLACEHOLDER_LOGPROB] * len(tokens))
        s.tool_spans.append((n, n + len(tokens)))
        s.finish_reason = ""  # running again
        return True

    # ------------------------------------------------------------------------------------------ helpers
    def _submit(self, s: Sample, parsed: Any) -> None:
        self._serial += 1
        key = f"{s.sample_id}#{self._serial}"  # one key per submission: a dropped call's late outcome is ignored
        s.meta["awaiting_tools"] = True
        self.waiting[key] = s
        self.record("tool_call", s)
        self.runner.submit(key, parsed, dict(s.meta.get("tool_state") or initial_state(s)))

    def _final(self, s: Sample, how: str) -> bool:
        start = self.turn_start(s)
        s.meta.setdefault("trajectory", []).append(
            {"role": "assistant", "content": self._decode(s.response_tokens[start:])})
        s.meta["trajectory_end"] = how
        return False

    def _decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def close(self) -> None:
        self.runner.close()


def render_worked(tokenizer: Any, renderer: ToolRenderer, messages: list[dict], eos: int) -> tuple[list[int], list[int]]:
    """(response tokens, loss mask) of a worked trajectory (`[{"role": "assistant" | "tool", "content"}, ...]`,
    assistant first and last) exactly as the rollout loop builds it: each assistant turn tokenised as the engine
    would have generated it (a calling turn ends on the parser's stop token), the tool messages between two turns
    rendered by `renderer` and masked (0), the final turn followed by `eos`. The supervised warm start trains
    on it (warmup.py), so it learns the format RL samples in."""
    if not messages or messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        raise ValueError("a worked trajectory starts with an assistant turn and ends on one (the final answer)")
    tokens: list[int] = []
    mask: list[int] = []
    tools: list[str] = []
    for m in messages:
        if m["role"] == "tool":
            tools.append(m["content"])
            continue
        if m["role"] != "assistant":
            raise ValueError(f"a worked trajectory has assistant and tool messages only, got {m['role']!r}")
        if tools:
            span = renderer.tokens(tools)
            tokens += span
            mask += [0] * len(span)
            tools = []
        turn = list(tokenizer.encode(m["content"], add_special_tokens=False))
        tokens += turn
        mask += [1] * len(turn)
    return tokens + [eos], mask + [1]


def initial_state(s: Sample) -> dict:
    """A trajectory's tool state before its first call: the data row's per-row tool arguments, if any
    (`meta["tools_kwargs"]`, verl's `extra_info.tools_kwargs`)."""
    kwargs = s.meta.get("tools_kwargs")
    return {"tools_kwargs": kwargs} if kwargs else {}


def trajectory_info(s: Sample) -> tuple[int, float]:
    """A finished trajectory's (assistant turns, tool seconds), what the scheduler's history records."""
    return s.turns, float(s.meta.get("tool_seconds", 0.0))


def step_metrics(batch: list[Sample]) -> dict[str, float]:
    """Per-step tool metrics of a trained batch (docs/telemetry.md, "Tools")."""
    seconds = [float(s.meta.get("tool_seconds", 0.0)) for s in batch]
    n = max(1, len(batch))
    out = {"tools/calls": float(sum(s.meta.get("tool_calls", 0) for s in batch)),
           "tools/errors": float(sum(s.meta.get("tool_errors", 0) for s in batch)),
           "tools/turns_per_trajectory": sum(s.turns for s in batch) / n,
           "tools/seconds": max(seconds, default=0.0),  # the longest trajectory's tool wait: the critical path
           "tools/seconds_total": sum(seconds),
           "tools/calling_share": sum(1 for s in batch if s.meta.get("tool_calls")) / n}
    for s in batch:
        for kind, k in s.meta.get("tool_error_kinds", {}).items():
            out[f"tools/errors_{kind}"] = out.get(f"tools/errors_{kind}", 0.0) + k
    return out


def trajectories_for(cfg, tokenizer: Any, record: Callable[[str, Sample], None] | None = None,
                     runner: Any = None) -> Trajectories | None:
    """The run's trajectory loop (with its tool runner), or None when `tools.tools` is empty."""
    if not cfg.tools.tools:
        return None
    if not cfg.data.apply_chat_template:
        raise ConfigError("data.apply_chat_template", False, "true when tools.tools is set: the tool schemas and "
                          "the tool messages reach the model through its chat template")
    return Trajectories.from_config(cfg, tokenizer, runner=runner, record=record)


def sample_meta(prompt: Any) -> dict:
    """What a new sample takes from its prompt for its tools: the row's per-row tool arguments."""
    kwargs = prompt.meta.get("tools_kwargs")
    return {"tools_kwargs": kwargs} if kwargs else {}
