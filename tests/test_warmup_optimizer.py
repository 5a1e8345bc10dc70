"""RL after the warm start begins with a fresh Adam (`trainer.warmup_reset_optimizer`).

    pytest tests/test_warmup_optimizer.py -q      # a Megatron trainer on CPU, in a spawned subprocess

Hardware: CPU only. Adam's first step from empty moments moves every parameter by exactly lr * g / (|g| + eps),
so by lr wherever the gradient is well above eps: that golden step is what the reset must give. Without the
reset the same step, taken with the warm start's moments, is not that step (the control).
"""

from __future__ import annotations

import torch

from stream_support import in_process_group, model_dir, run_child  # noqa: F401 - model_dir is a fixture
from megatron_sortedrl.config import RunConfig

LR = 1e-3


def _pairs(seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(4, 100, (6,), generator=g).tolist(), torch.randint(4, 100, (5,), generator=g).tolist())
            for _ in range(4)]


def _step_after_warm_start(model_dir: str, reset: bool, out) -> None:
    """Three supervised steps, the reset or not, then one more supervised step at LR; puts (dropped states,
    states left after the reset, elements with a gradient above eps, the step's largest distance from the
    golden step over them) on `out` (plain numbers: a child's shared tensors die with it)."""
    try:
        cfg = RunConfig()
        cfg.model.path = model_dir
        cfg.cluster.device = "cpu"
        cfg.trainer.warmup_sft_lr = LR
        cfg.trainer.grad_clip = 0.0  # the golden step below reads the raw gradient
        group = in_process_group(cfg)
        w = group.worker
        for seed in range(3):
            group.sft_step(_pairs(seed))
        dropped = group.reset_optimizer() if reset else 0
        left = sum(len(o.optimizer.state) for o in getattr(w.opt, "chained_optimizers", [w.opt]))
        # the gradient of the last step, taken without an update (same weights, same pairs)
        items = [group._item(p, t, None, None) for p, t in _pairs(7)]
        w._forward_backward(items, "sft")
        grads = {n: p.main_grad.detach().clone() for n, p in w.module.named_parameters()}
        from megatron_sortedrl.trainer.optimizer import zero_grads

        zero_grads(w.opt, [w.model])
        before = {n: p.detach().clone() for n, p in w.module.named_parameters()}
        group.sft_step(_pairs(7))
        delta = {n: (p.detach() - before[n]).abs() for n, p in w.module.named_parameters()}
        grads = {n: g.abs() for n, g in grads.items()}
        out.put((dropped, left, sum(int((g > 1e-5).sum()) for g in grads.values()), _off_golden(delta, grads)))
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        out.put(e)


def _off_golden(delta: dict, grads: dict) -> float:
    """The largest |delta - LR| over parameter elements whose gradient is well above Adam's eps."""
    worst = 0.0
    for n, d in delta.items():
        sel = grads[n] > 1e-5
        if bool(sel.any()):
            worst = max(worst, float((d[sel] - LR).abs().max()))
    return worst


def test_reset_gives_the_first_step_of_a_fresh_adam(model_dir):
    dropped, left, covered, off = run_child(_step_after_warm_start, str(model_dir), True)
    assert dropped > 0 and left == 0
    assert covered > 1000  # the golden check covers many elements
    assert off < LR * 0.02


def test_without_the_reset_the_step_keeps_the_warm_start_moments(model_dir):
    dropped, left, covered, off = run_child(_step_after_warm_start, str(model_dir), False)
    assert dropped == 0 and left > 0 and covered > 1000
    assert off > LR * 0.2
