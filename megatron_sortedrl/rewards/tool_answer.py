"""Exact-answer reward for tool-using trajectories: the integer after `####` in the final assistant turn.

    data.reward_fn=megatron_sortedrl.rewards.tool_answer.reward     # the default of data.task=tool_multiplication

The answer is read from the trajectory's last assistant message (`sample.meta["trajectory"]`, docs/agentic.md),
never from tool output: a tool's answer copied into the response by the template earns nothing by itself.
Without a trajectory (a one-turn sample) the whole response is read, as `rewards.arithmetic` does.
"""

from __future__ import annotations

from megatron_sortedrl.rewards.arithmetic import extract_answer


def final_turn(sample) -> str:
    """The text of the last assistant turn, or the whole response when the sample is no trajectory."""
    messages = (getattr(sample, "meta", None) or {}).get("trajectory") or []
    if messages:
        return messages[-1]["content"] if messages[-1].get("role") == "assistant" else ""
    return sample.response_text


def reward(sample, ground_truth: str) -> float:
    answer = extract_answer(final_turn(sample))
    return 1.0 if answer is not None and answer == (ground_truth.strip().lstrip("0") or "0") else 0.0
