"""Write-a-function problems with hidden unit tests: the built-in code task (`data.task=code`).

    from megatron_sortedrl.data.code_task import generate
    prompts = generate(num=256, seed=0, min_difficulty=1, max_difficulty=6)

A problem of difficulty d asks for `f(x)` on integers as a chain of d steps written tersely in the prompt;
the worked solution is a Python function with one statement per step, so its length grows with d (about
16 characters a step, conditional steps take two lines). Example for `f(x): *3 +2 even:/2 max4`:

    def f(x):
        x = x * 3
        x = x + 2
        if x % 2 == 0:
            x = x // 2
        x = max(x, 4)
        return x

The ground truth is the hidden tests in the call-based layout of `rewards/code.py`
(`{"fn_name": "f", "inputs": [[x], ...], "outputs": [y, ...]}`), computed by running the worked solution.
Difficulties are drawn with weight 1/d as in the arithmetic task: most programs are short, a few long.
Like the arithmetic task, it is made for the tiny character-level model: a short supervised warm start on
the worked solutions teaches the format, and RL has room to fix the long chains.

Left out: problems needing algorithms (loops, data structures); a model of a few hundred thousand
parameters cannot learn them here. Real code data comes in as files (data.task=file, verl/DeepCoder layout).
"""

from __future__ import annotations

import json
import random

from megatron_sortedrl.sample import Prompt

NUM_TESTS = 6

# (prompt token, solution lines); {c} is the step's constant.
_STEPS = {
    "add": ("+{c}", ["x = x + {c}"]),
    "sub": ("-{c}", ["x = x - {c}"]),
    "mul": ("*{c}", ["x = x * {c}"]),
    "mod": ("%{c}", ["x = x % {c}"]),
    "div": ("/{c}", ["x = x // {c}"]),
    "max": ("max{c}", ["x = max(x, {c})"]),
    "min": ("min{c}", ["x = min(x, {c})"]),
    "abs": ("abs", ["x = abs(x)"]),
    "neg": ("neg", ["x = -x"]),
    "even": ("even:/2", ["if x % 2 == 0:", "    x = x // 2"]),
    "odd": ("odd:+{c}", ["if x % 2 == 1:", "    x = x + {c}"]),
}
_NAMES = sorted(_STEPS)


def make_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    """(prompt spec, worked solution) for a chain of `difficulty` steps."""
    spec, body = [], []
    for _ in range(difficulty):
        name = rng.choice(_NAMES)
        c = rng.randint(2, 9)
        token, lines = _STEPS[name]
        spec.append(token.format(c=c))
        body.extend("    " + line.format(c=c) for line in lines)
    solution = "def f(x):\n" + "\n".join(body) + "\n    return x\n"
    return "f(x): " + " ".join(spec), solution


def run_solution(solution: str, inputs: list[int]) -> list[int]:
    """The hidden tests' expected outputs: the worked solution (our own generated code) run on the inputs."""
    scope: dict = {}
    exec(compile(solution, "<solution>", "exec"), scope)
    return [scope["f"](x) for x in inputs]


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int, id_prefix: str = "code") -> list[Prompt]:
    """`num` prompts; the same seed always gives the same prompts (ids, text, tests)."""
    rng = random.Random(seed)
    levels = list(range(min_difficulty, max_difficulty + 1))
    weights = [1.0 / d for d in levels]
    prompts = []
    for i in range(num):
        difficulty = rng.choices(levels, weights)[0]
        spec, solution = make_problem(rng, difficulty)
        inputs = [rng.randint(-30, 30) for _ in range(NUM_TESTS)]
        truth = {"fn_name": "f", "inputs": [[x] for x in inputs], "outputs": run_solution(solution, inputs)}
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text=spec + "\n",
            ground_truth=json.dumps(truth),
            source="code",
            difficulty=difficulty,
            solution=solution,
        ))
    return prompts
