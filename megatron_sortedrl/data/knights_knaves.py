"""Knights-and-Knaves puzzles with 2-7 inhabitants (LogicRL style), each with a unique solution.

    from megatron_sortedrl.data.knights_knaves import generate
    prompts = generate(num=100, seed=0, min_difficulty=2, max_difficulty=7)   # difficulty = people

Knights always tell the truth and knaves always lie; every inhabitant makes one statement about the
others. A puzzle is kept only when brute force over all 2^n assignments finds exactly one consistent
assignment (`solve` returns them all, so uniqueness is checked, not assumed). The worked solution walks
through each statement under the solution, so its length grows with the number of people and the
statements' complexity. The answer format is the one LogicRL uses:

    <answer>(1) Zoey is a knight
    (2) Oliver is a knave</answer>

Left out: natural-language paraphrase variety (one template per statement kind).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from megatron_sortedrl.sample import Prompt

NAMES = ["Zoey", "Oliver", "Ethan", "Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia", "Owen", "Ruby"]
KINDS = ("knave", "knight")  # index by bool: True is a knight


@dataclass(frozen=True)
class Statement:
    """kind: is (a is `value`), and / or (a and/or b are knights), same / diff (a and b same or different kind),
    imply (if a is a knight then b is a knave)."""

    kind: str
    a: int
    b: int = -1
    value: bool = True

    def holds(self, assignment: tuple[bool, ...]) -> bool:
        x = assignment[self.a]
        y = assignment[self.b] if self.b >= 0 else None
        return {
            "is": lambda: x == self.value,
            "and": lambda: x and y,
            "or": lambda: x or y,
            "same": lambda: x == y,
            "diff": lambda: x != y,
            "imply": lambda: (not x) or (not y),
        }[self.kind]()

    def text(self, names: list[str]) -> str:
        a = names[self.a]
        b = names[self.b] if self.b >= 0 else ""
        return {
            "is": f"{a} is a {KINDS[self.value]}",
            "and": f"{a} and {b} are both knights",
            "or": f"{a} or {b} is a knight",
            "same": f"{a} and {b} are the same kind",
            "diff": f"{a} and {b} are different kinds",
            "imply": f"if {a} is a knight then {b} is a knave",
        }[self.kind]


def solve(statements: list[Statement], n: int) -> list[tuple[bool, ...]]:
    """Every assignment in which each speaker is a knight exactly when their statement holds."""
    return [
        assignment
        for assignment in itertools.product((False, True), repeat=n)
        if all(assignment[speaker] == s.holds(assignment) for speaker, s in enumerate(statements))
    ]


def _random_statement(rng: random.Random, speaker: int, n: int) -> Statement:
    others = [i for i in range(n) if i != speaker]
    kind = rng.choice(["is", "is", "and", "or", "same", "diff", "imply"] if n > 2 else ["is", "is", "same", "diff"])
    if kind == "is":
        return Statement("is", rng.choice(others), value=rng.random() < 0.5)
    a, b = rng.sample(others, 2) if len(others) >= 2 else (others[0], speaker)
    return Statement(kind, a, b)


def make_puzzle(rng: random.Random, n: int, max_tries: int = 10_000) -> tuple[list[str], list[Statement], tuple[bool, ...]]:
    names = rng.sample(NAMES, n)
    for _ in range(max_tries):
        statements = [_random_statement(rng, speaker, n) for speaker in range(n)]
        solutions = solve(statements, n)
        if len(solutions) == 1:
            return names, statements, solutions[0]
    raise RuntimeError(f"no unique {n}-person puzzle found in {max_tries} tries")


def answer_text(names: list[str], assignment: tuple[bool, ...]) -> str:
    return "\n".join(f"({i + 1}) {name} is a {KINDS[k]}" for i, (name, k) in enumerate(zip(names, assignment)))


def worked_solution(names: list[str], statements: list[Statement], assignment: tuple[bool, ...]) -> str:
    lines = []
    for speaker, s in enumerate(statements):
        truth = s.holds(assignment)
        lines.append(f"{names[speaker]} is a {KINDS[assignment[speaker]]}, so \"{s.text(names)}\" is {str(truth).lower()}.")
    lines.append("Every statement is consistent, and no other assignment is.")
    return "\n".join(lines) + f"\n<answer>{answer_text(names, assignment)}</answer>"


def generate(num: int, seed: int, min_difficulty: int, max_difficulty: int, id_prefix: str = "kk") -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        n = rng.randint(min_difficulty, max_difficulty)
        names, statements, assignment = make_puzzle(rng, n)
        said = " ".join(f"{names[k]} says: \"{s.text(names)}.\"" for k, s in enumerate(statements))
        text = (
            "Knights always tell the truth and knaves always lie. "
            f"You meet {n} inhabitants: {', '.join(names)}. {said} Who is a knight and who is a knave?\n"
        )
        prompts.append(Prompt(
            prompt_id=f"{id_prefix}-{seed}-{i}",
            text=text,
            ground_truth=answer_text(names, assignment),
            source="knights_knaves",
            difficulty=n,
            solution=worked_solution(names, statements, assignment),
            meta={"names": names},
        ))
    return prompts
