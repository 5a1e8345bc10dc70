"""Multi-turn trajectories driven through one vLLM `LLM` in lockstep turns: HistoSpec's trajectory tests and benchmark.

    trajs = replay(llm, prompts, answer, max_turns=3, max_turn_tokens=64, stop_ids=[stop], temperature=1.0,
                   seed=0, renderer=ToolRenderer(tokenizer), decode=tokenizer.decode)
    tokens, lens = split_turns(trajs[i].response, trajs[i].tool_spans)      # what the history stores

Each turn is one engine request whose prompt is the prompt plus everything so far (what the rollout loop sends
for a continued request, megatron_sortedrl/agentic/trajectory.py); all live trajectories' turn k go to the engine
together. After a turn, `answer(k, turn_text)` gives the tool message's content (None: the trajectory ends), and
the chat template's rendering of it is appended as a tool span. A turn that ended on EOS ends the trajectory.

Left out: the driver's asynchrony (tools overlapping generation, aborts, carry-over); the real rollout loop is
tested in tests/test_agentic_*.py. Here the point is the engine's drafting across turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Trajectory:
    prompt: list[int]  # the prompt's token ids
    response: list[int] = field(default_factory=list)  # generated turns and rendered tool messages, in order
    tool_spans: list[tuple[int, int]] = field(default_factory=list)  # response ranges that came from tools
    done: bool = False


def replay(llm: Any, prompts: list[list[int]], answer: Callable[[int, str], str | None], max_turns: int,
           max_turn_tokens: int, stop_ids: list[int], temperature: float, seed: int, renderer: Any,
           decode: Callable[[list[int]], str], eos_id: int = 0, max_len: int = 1 << 30) -> list[Trajectory]:
    """One trajectory per prompt (repeat a prompt for several samples); request i of turn k is seeded
    `seed + 1000 * k + i`, so a replay with the same seed samples the same way whatever the speculation.
    `max_len` (the engine's context): a turn is cut there, and a tool message that would leave no room for one
    more generated token is not appended (the trajectory ends, as the rollout loop's "length")."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    trajs = [Trajectory(list(p)) for p in prompts]
    for k in range(max_turns):
        live = [i for i, t in enumerate(trajs) if not t.done]
        if not live:
            break
        reqs = [TokensPrompt(prompt_token_ids=trajs[i].prompt + trajs[i].response) for i in live]
        params = [SamplingParams(temperature=temperature, stop_token_ids=stop_ids, detokenize=False,
                                 max_tokens=min(max_turn_tokens, max_len - len(trajs[i].prompt) - len(trajs[i].response)),
                                 seed=seed + 1000 * k + i) for i in live]
        outs = llm.generate(reqs, params, use_tqdm=False)
        for i, out in zip(live, outs):
            t, turn = trajs[i], list(out.outputs[0].token_ids)
            t.response += turn
            reply = None if (turn and turn[-1] == eos_id) or k == max_turns - 1 else answer(k, decode(turn))
            if reply is None:
                t.done = True
                continue
            msg = renderer.tokens([reply])
            if len(t.prompt) + len(t.response) + len(msg) + 1 > max_len:
                t.done = True
                continue
            t.tool_spans.append((len(t.response), len(t.response) + len(msg)))
            t.response += msg
    return trajs
