"""Long multiplication with the calculator: a task the tiny model cannot do in its head but can with a tool
(`data.task=tool_multiplication`, the tools run: configs/tools_cpu.yaml).

    from megatron_sortedrl.data.tool_multiplication import generate, worked_messages
    prompts = generate(num=128, seed=0, min_difficulty=2, max_difficulty=4)

A prompt of difficulty d multiplies two numbers, the first with exactly d digits and the second with 2..d
(`4821*3907=`). A 2-layer character-level model cannot multiply 4-digit numbers; it can copy the operands into
a calculator call and copy the tool's answer back. The worked solution (`Prompt.meta["worked"]`, the messages
the supervised warm start renders through the chat template exactly as a rollout does) is one trajectory:

    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "4821*3907"}}\\n</tool_call>
    tool       18835647
    assistant  #### 18835647

`Prompt.solution` is the final answer line (`#### <product>`, what `trainer.warmup_answer_only_share` keeps:
an answer without the tool, which the tiny model gets right only by luck on small operands). The reward
(`megatron_sortedrl.rewards.tool_answer.reward`) reads the final assistant turn.

Every character of prompts, calls and tool answers is printable ASCII, which the tiny model's character
vocabulary covers (tests/test_tool_multiplication.py checks it).

Left out: other operations and tools (the calculator does them; this task exists to make one tool matter) and
wrong tool answers (the calculator is exact).
"""

from __future__ import annotations

import random

from megatron_sortedrl.agentic.parsers import ToolCall, render_calls
from megatron_sortedrl.sample import Prompt

ANSWER_MARK = "####"


def worked_messages(expression: str, product: int) -> list[dict]:
    """The worked trajectory: the call, the calculator's answer, the final answer."""
    call = render_calls([ToolCall("calculator", {"expression": expression})])
    return [{"role": "assistant", "content": call}, {"role": "tool", "content": str(product)},
            {"role": "assistant", "content": f"{ANSWER_MARK} {product}"}]


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int,
             id_prefix: str = "tool_multiplication") -> list[Prompt]:
    """`num` prompts; the same seed always gives the same prompts (ids, text, answers, worked trajectories)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        d = rng.randint(min_difficulty, max_difficulty)
        a = rng.randint(10 ** (d - 1), 10**d - 1)
        e = rng.randint(min(2, d), d)
        b = rng.randint(10 ** (e - 1), 10**e - 1)
        expression = f"{a}*{b}"
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text=f"{expression}=",
            ground_truth=str(a * b),
            source="tool_multiplication",
            difficulty=d,
            solution=f"{ANSWER_MARK} {a * b}",
            meta={"worked": worked_messages(expression, a * b)},
        ))
    return prompts
