"""DAPO's overlong reward shaping of an update batch: the soft overlong penalty and overlong filtering.

    from megatron_sortedrl.shaping import shape_batch
    batch, metrics = shape_batch(batch, cfg.sampling, cfg.rollout.max_response_length)
    pytest tests/test_selective.py -k shape_batch

A loss-side rule, so it sits beside the loss (`algorithms.overlong_penalty` is the penalty; a masked sample's
tokens are left out of the policy loss), not in the scheduler: the scheduling policies decide what is generated
and harvested, this decides what a harvested sample is worth to the update. Settings are `sampling.overlong_*`
(`scheduler.config.SamplingConfig`); docs/selective_rollout.md.

Left out: any shaping of groups (dynamic sampling's filter stays in `scheduler/selective.py`).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_sortedrl.algorithms import overlong_penalty
from megatron_sortedrl.sample import Sample
from scheduler.config import SamplingConfig


def shape_batch(batch: list[Sample], cfg: SamplingConfig, max_response_length: int) -> tuple[list[Sample], dict[str, float]]:
    """DAPO overlong shaping of an update batch: returns copies with the soft overlong penalty added to the reward
    and `meta["loss_masked"]` set on truncated responses (overlong filtering), plus per-step metrics. The samples
    passed in keep their task reward (logs and accuracy read it)."""
    if not batch or (cfg.overlong_buffer <= 0 and not cfg.overlong_filter):
        return batch, {}
    out, penalized, masked, total = [], 0, 0, 0.0
    for s in batch:
        pen = overlong_penalty(s.response_length, max_response_length, cfg.overlong_buffer, cfg.overlong_penalty) \
            if cfg.overlong_buffer > 0 else 0.0
        truncated = cfg.overlong_filter and s.finish_reason == "length"
        penalized += pen < 0
        masked += truncated
        total += pen
        meta = {**s.meta, "loss_masked": True} if truncated else s.meta
        out.append(replace(s, reward=float(s.reward or 0.0) + pen, meta=meta) if (pen or truncated) else s)
    n = len(batch)
    return out, {"overlong/penalized_share": penalized / n, "overlong/penalty_mean": total / n,
                 "overlong/masked": float(masked), "overlong/masked_share": masked / n}
