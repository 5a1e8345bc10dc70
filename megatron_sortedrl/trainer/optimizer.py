"""Megatron optimizer, learning-rate schedule and one guarded optimizer step.

    opt, sched = build_optimizer(ddp_model, cfg, on_gpu=False)
    metrics = optimizer_step(opt, sched, [ddp_model], loss, grad_clip=1.0, on_gpu=False)
    ddp_cfg = ddp_config(cfg, gpu=False, dp=1)             # Megatron DDP settings (bucket size, overlap)

GPU: Megatron's optimizer with the distributed optimizer (when `parallel.use_distributed_optimizer`),
bf16/fp16 mixed precision and Megatron's own gradient clipping. CPU: the same `get_megatron_optimizer`
call with `clip_grad=0` (its clipping asserts CUDA tensors) and no distributed optimizer (it refuses CPU
tensors); clipping is done here with Megatron's duplicate-aware global norm (TP-replicated parameters and
the tied embedding copy are counted once), so the clipped update is identical at any TP/PP.

Every step first checks the loss and all local gradients for inf/nan and agrees on the answer across the
whole world; a non-finite step is skipped (gradients zeroed, parameters and optimizer state untouched,
the schedule not advanced) and counted.

Deliberately left out: fp16 loss scaling on CPU, CPU offloading of optimizer state.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def build_optimizer(model_chunks: list, cfg, *, on_gpu: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = cfg.model.dtype
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=cfg.trainer.lr,
        min_lr=0.0,
        weight_decay=cfg.trainer.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=getattr(torch, dtype),
        clip_grad=cfg.trainer.grad_clip if on_gpu else 0.0,
        use_distributed_optimizer=bool(on_gpu and cfg.parallel.use_distributed_optimizer),
    )
    opt = get_megatron_optimizer(ocfg, model_chunks)
    total = max(cfg.trainer.total_steps, 1)
    warmup = min(cfg.trainer.lr_warmup_steps, total - 1) if total > 1 else 0
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0 if warmup else cfg.trainer.lr,
        max_lr=cfg.trainer.lr,
        min_lr=0.0,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=cfg.trainer.lr_decay_style,
        start_wd=cfg.trainer.weight_decay,
        end_wd=cfg.trainer.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return opt, sched


def set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def reset_state(opt) -> int:
    """Forgets the Adam moments and step counts of every parameter (chained, mixed-precision or distributed
    Megatron optimizer); the next step initialises them afresh, as a new optimizer's first step does. The
    parameters, fp32 master copies and the learning-rate schedule stay. Returns the per-parameter states
    dropped. Used after the supervised warm start: its second moments, from gradients much larger than RL's,
    would otherwise shrink the first few hundred RL updates (beta2 = 0.999)."""
    dropped = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = o.optimizer
        dropped += len(inner.state)
        inner.state.clear()
    return dropped


def _local_grads(model_chunks: list) -> list[torch.Tensor]:
    grads = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None:
                grads.append(g)
    return grads


def all_finite(loss: float, model_chunks: list) -> bool:
    """True when the loss and every gradient on every rank are finite (a world-wide agreement)."""
    bad = 0.0 if math.isfinite(loss) else 1.0
    for g in _local_grads(model_chunks):
        if not bool(torch.isfinite(g).all()):
            bad = 1.0
            break
    device = _local_grads(model_chunks)[0].device if _local_grads(model_chunks) else "cpu"
    flag = torch.tensor([bad], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


def zero_grads(opt, model_chunks: list) -> None:
    for chunk in model_chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    opt.zero_grad()


def optimizer_step(opt, sched, model_chunks: list, loss: float, *, grad_clip: float, on_gpu: bool,
                   lr_override: float | None = None, advance_schedule: bool = True) -> dict[str, float]:
    """One update after backward + gradient reduction; returns metrics (skipped, grad_norm, lr).
    `advance_schedule=False` keeps the schedule where it is (a later mini-batch of the same RL step)."""
    if not all_finite(loss, model_chunks):
        zero_grads(opt, model_chunks)
        return {"skipped": 1.0, "grad_norm": float("nan"), "lr": opt.param_groups[0]["lr"]}
    if lr_override is not None:
        set_lr(opt, lr_override)
    elif advance_schedule:
        # Advance first, so RL step k (1-based) runs at the schedule's value for k: warm-up never starts
        # with a zero learning rate, and a supervised step's lr never leaks into an RL step.
        sched.step(increment=1)
    lr = opt.param_groups[0]["lr"]
    if on_gpu:
        ok, grad_norm, _ = opt.step()
        if not ok:  # fp16 loss-scale overflow
            zero_grads(opt, model_chunks)
            return {"skipped": 1.0, "grad_norm": float("nan"), "lr": opt.param_groups[0]["lr"]}
    else:
        opt.prepare_grads()
        grad_norm = opt.get_grad_norm()
        if grad_clip > 0:
            coeff = grad_clip / (grad_norm + 1e-6)
            if coeff < 1.0:
                for g in _param_grads(opt):
                    g.mul_(coeff)
        opt.step_with_ready_grads()
    zero_grads(opt, model_chunks)
    return {"skipped": 0.0, "grad_norm": float(grad_norm), "lr": lr}


def _param_grads(opt) -> list[torch.Tensor]:
    return [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]


def ddp_config(cfg, gpu: bool, dp: int):
    """Megatron DDP settings: on a GPU the gradient reduction overlaps the backward pass.

    Buckets of max(40M, 1M x DP) elements, Megatron-LM's default: big enough to keep NCCL efficient,
    small enough that the first buckets are reduced while later layers are still in backward.
    `overlap_param_gather` stays off: with it the distributed optimizer's parameter all-gather finishes
    only in the next forward's hooks, but this trainer reads the new weights right after every update
    (rollout weight sync, export, checkpoints), so the gather would have to be forced there anyway and
    a reader that forgot would publish stale weights. CPU (gloo) keeps everything synchronous."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, check_for_nan_in_grad=False,
        use_distributed_optimizer=bool(gpu and cfg.parallel.use_distributed_optimizer),
        overlap_grad_reduce=gpu, overlap_param_gather=False,
        bucket_size=max(40_000_000, 1_000_000 * dp) if gpu else None)
