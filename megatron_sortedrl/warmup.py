"""The supervised warm start before RL: worked solutions of the task, then the engines get the weights.

    from megatron_sortedrl.warmup import warm_start, sft_problems
    info = warm_start(driver)          # what Driver.warm_start runs; returns the last step's metrics

`trainer.warmup_sft_steps` steps of `trainer.warmup_sft_batch` (prompt, worked solution) pairs each, drawn
with the run's seed, at `trainer.warmup_sft_lr`, through the same Megatron trainer that RL uses; then the
optimizer forgets its moments (`trainer.warmup_reset_optimizer`) and the weights go to the engines as policy
version 0.

Where the solutions come from (`sft_problems`): by default the training prompts. With
`trainer.warmup_sft_problems: N` and a procedural task, N fresh problems of the task drawn with another seed
than the training and held-out sets: a warm start on a few hundred RL prompts memorizes their solutions
instead of learning the procedure (measured on the long-tail preset: 0.64 reward on 32 memorized prompts,
0.11 held out), and RL then starts from a policy that already knows its own prompts.

A problem with a worked tool-using trajectory (`Prompt.meta["worked"]`, data.task=tool_multiplication) trains on
the whole conversation as the rollout loop renders it: its assistant turns as targets, the chat template's
rendering of the tool messages between them masked from the loss (`sft_pair`). A problem cut to its answer
(`trainer.warmup_answer_only_share`) answers without a tool.

Left out: a learning-rate schedule for the warm start (one constant rate, as the trainer's supervised step
takes it) and curricula (the problems follow the task's own distribution).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.sample import Prompt

# The fresh warm-start problems use this seed offset; the held-out set uses data.seed + 1_000_003.
SFT_SEED_OFFSET = 2_000_003
ANSWER_ONLY_SEED_OFFSET = 3_000_017  # which warm-start problems lose their worked steps


def sft_problems(cfg, train_prompts: list[Prompt]) -> list[Prompt]:
    """The problems the warm start trains on: `trainer.warmup_sft_problems` fresh ones of a procedural task
    (another seed than train and eval), else the training prompts. Only problems with a worked solution."""
    n = cfg.trainer.warmup_sft_problems
    if n and cfg.data.task != "file":
        from megatron_sortedrl.data import load_prompts

        pool = load_prompts(replace(cfg.data, num_train_prompts=n, seed=cfg.data.seed + SFT_SEED_OFFSET), "train")
    else:
        pool = list(train_prompts)
    pool = [p for p in pool if p.solution]
    share = cfg.trainer.warmup_answer_only_share
    if share > 0:  # a fixed draw per problem (the data seed), the same in every run of the same config
        rng = random.Random(cfg.data.seed + ANSWER_ONLY_SEED_OFFSET)
        # an answer-only problem loses its worked trajectory too: it answers without calling a tool
        pool = [replace(p, solution=answer_only(p.solution, p.ground_truth),
                        meta={k: v for k, v in p.meta.items() if k != "worked"}) if rng.random() < share else p
                for p in pool]
    return pool


def answer_only(solution: str, answer: str) -> str:
    """A worked solution cut to its answer: its last line where that is the `#### <answer>` line (arithmetic,
    long_addition, whose rewards read that line: a right direct answer scores 1), else `#### <answer>`
    (column_addition, whose reward reads only the column lines: a direct answer scores 0, show your work)."""
    last = solution.rstrip().splitlines()[-1]
    return last if last.startswith("####") else f"#### {answer}"


def sft_pair(driver: Any, p: Prompt) -> tuple:
    """(prompt ids, target ids) of a worked solution, or (prompt ids, target ids, loss mask) of a worked tool-
    using trajectory (`p.meta["worked"]`): the whole conversation rendered as the rollout loop renders it, tool
    messages masked (agentic/trajectory.py, `render_worked`)."""
    prompt = driver.encoder.encode(p)
    worked = p.meta.get("worked")
    if not worked:
        return prompt, driver.tok(p.solution)["input_ids"] + [driver.eos]
    if driver.agentic is None:
        raise ConfigError("tools.tools", [], "the tools the worked solutions of data.task call (e.g. [calculator])")
    from megatron_sortedrl.agentic.trajectory import render_worked

    return (prompt, *render_worked(driver.tok, driver.agentic.renderer, worked, driver.eos))


def warm_start(driver: Any) -> dict[str, float]:
    """Supervised steps on worked solutions, then the engines get the warmed-up weights (version 0)."""
    cfg = driver.cfg
    steps, batch = cfg.trainer.warmup_sft_steps, cfg.trainer.warmup_sft_batch
    if not steps:
        return {}
    pool = sft_problems(cfg, list(driver.prompts.values()))
    if not pool:
        driver.say("warm-up skipped: no problem with a worked solution (file datasets carry none)")
        return {}
    rng = random.Random(cfg.seed)
    out: dict[str, float] = {}
    t0 = time.monotonic()
    for i in range(steps):
        pairs = [sft_pair(driver, p) for p in rng.sample(pool, min(batch, len(pool)))]
        out = driver.trainer.sft_step(pairs)
        if (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            driver.say(f"warm-up {i + 1}/{steps}: loss {out.get('loss', float('nan')):.3f} "
                       f"({time.monotonic() - t0:.0f}s, {len(pool)} problems)")
    if cfg.trainer.warmup_reset_optimizer:  # RL starts from a fresh Adam (the option's help says why)
        driver.trainer.reset_optimizer()
    driver.colo.hand_off(0)  # colocate/: the plain sync, after the engines' weights woke on a colocated layout
    return out
