"""Per-rank trainer logic: one process of the TP x PP x DP world (run inside a Ray actor by `group.py`).

    w = TrainerWorker(cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    w.setup(); w.logprobs(items); w.train_step(items, "rl"); w.save("ckpt/iter_1", {}); w.shutdown()

Every public method is a collective: the group calls it on all ranks with the same arguments. Items are
plain dicts (see `group.py`), so the module needs no Ray and tests can drive it from any process.
Data parallelism: items are sorted by length and dealt round-robin to the DP replicas; all ranks of a
replica (its TP x PP ranks) see the same shard and the same micro-batches. Results come back from the
last pipeline stage's TP-rank-0 of each replica; the group merges them.

Loss scaling: each micro-batch returns `sum(w * per_token_loss) * num_microbatches * dp`, where the
weights `w` use the *global* token / sequence counts. Megatron's schedule divides by the number of
micro-batches and its DDP averages over DP, so the gradient is exactly that of the global aggregated loss
at any layout.

Mini-batches: `train_step(items, old_logprobs in the items, advance_schedule=...)` is one optimizer step; the
group (`group.py`, `train_minibatches`) runs one per mini-batch of a harvest with the harvest's old log-probs
held fixed, advancing the learning-rate schedule on the harvest's first step only (as verl steps it once per
rollout step). Without old log-probs the proximal policy is the current one (exact for one step per harvest).

Deliberately left out: virtual pipeline stages, context parallelism.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial

import torch

from megatron_sortedrl import algorithms as A
from megatron_sortedrl.host_heap import fix_host_mmap_threshold, trim_host_heap  # allocator policy: see there
from megatron_sortedrl.trainer import cpu_compat
from megatron_sortedrl.trainer.routing_replay import TrainerReplay, replaying
from megatron_sortedrl.trainer.offload import OffloadMixin
from megatron_sortedrl.trainer.optimizer import ddp_config, reset_state  # noqa: F401 (tests patch ddp_config)
from megatron_sortedrl.trainer.stream import StreamTrainingMixin
from megatron_sortedrl.trainer.weight_push import WeightPushMixin
from megatron_sortedrl.trainer.logprobs import (
    Sampling,
    SeqItem,
    make_microbatches,
    token_logprobs,
    token_logprobs_and_entropy,
)

METRIC_KEYS = ("loss", "n_tokens", "pg_loss", "clip_frac", "clip_frac_lower", "clip_frac_high", "clip_frac_low", "ratio",
               "ppo_kl", "tis_weight", "rollout_kl", "kl", "entropy",
               # trainer-rollout mismatch on the trained tokens and the share each correction masked (algorithms.py)
               "mismatch/logp_abs_diff", "mismatch/k3_kl", "mismatch/ratio_out_of_band", "correction/mis_masked",
               "correction/icepop_masked", "correction/seq_masked")
MAX_KEYS = ("ratio_max",)  # reduced by max over micro-batches and DP replicas, not summed


def on_gpu(cfg) -> bool:
    return cfg.cluster.device == "gpu" or (cfg.cluster.device == "auto" and torch.cuda.is_available())


class TrainerWorker(StreamTrainingMixin, OffloadMixin, WeightPushMixin):
    # stream_*: trainer/stream.py; *_state: trainer/offload.py; push_weights and the NCCL plan: trainer/weight_push.py
    def __init__(self, cfg, rank: int, world_size: int, master_addr: str, master_port: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.master = (master_addr, master_port)
        self.gpu = on_gpu(cfg)
        self.step = 0
        self.skipped_steps = 0
        self.ref_model = None

    # ------------------------------------------------------------------------------------- set-up

    def setup(self) -> dict:
        from megatron_sortedrl.trainer import kernels

        # Before megatron's first import in this process: a broken TE is blocked so megatron imports without it
        te = kernels.probe_transformer_engine() if self.gpu else kernels.NOT_PROBED

        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel

        from megatron_sortedrl.trainer.model import build_model, read_hf_config
        from megatron_sortedrl.trainer.moe import MoESettings, check_expert_layout, expert_tp, needs_sequence_parallel
        from megatron_sortedrl.trainer.optimizer import build_optimizer
        from megatron_sortedrl.trainer.weights import load_hf_weights

        cfg = self.cfg
        self.host_mmap_fixed = fix_host_mmap_threshold()  # before the model and optimizer allocate anything
        if self.gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1))
            self.kernels = kernels.probe_kernels(f"cuda:{torch.cuda.current_device()}", te=te)
            self.use_te = self.kernels.transformer_engine.ok
        else:
            self.kernels = kernels.cpu_probes()
            cpu_compat.activate()
            self.use_te = False
            if cfg.trainer.cpu_threads:  # (Ray pins an actor to one thread per reserved CPU: OMP_NUM_THREADS)
                torch.set_num_threads(cfg.trainer.cpu_threads)
        addr, port = self.master
        dist.init_process_group("nccl" if self.gpu else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=self.rank, world_size=self.world_size, timeout=timedelta(minutes=30))
        p = cfg.parallel
        self.arch = read_hf_config(cfg.model.path, cfg.model.rope_scaling)
        cfg.validate_model_shape(self.arch.num_heads, self.arch.num_kv_heads, self.arch.num_layers)
        check_expert_layout(self.arch, p)  # before any group: a layout Megatron cannot build, named by its key
        # Expert parallelism (MoE): EP x expert-TP groups carved out of each stage's TP x DP ranks (trainer/moe.py)
        ps.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                     expert_model_parallel_size=p.expert_model_parallel_size,
                                     expert_tensor_parallel_size=expert_tp(p))
        cpu_compat.seed_model_parallel(cfg.seed)
        self.dtype = getattr(torch, cfg.model.dtype)
        # Sequence parallelism and recompute run on both paths (on CPU through cpu_compat); Megatron only
        # turns sequence parallelism on at TP > 1, and an MoE model needs it there (trainer/moe.py).
        sp, rc = p.sequence_parallel or needs_sequence_parallel(self.arch, p.tensor_model_parallel_size), p.recompute
        self.sequence_parallel = sp
        moe = MoESettings.from_config(cfg)
        fusions = self.kernels.fusions()
        if self.rank == 0 and self.gpu:  # once per run: what was found, and what the trainer uses because of it
            print(f"[trainer] {self.kernels.line()}", flush=True)
        model = build_model(self.arch, self.dtype, use_te=self.use_te, sequence_parallel=sp, recompute=rc,
                            on_gpu=self.gpu, fusions=fusions, moe=moe)
        load_hf_weights(model, cfg.model.path, self.arch, use_te=self.use_te)
        ddp_cfg = ddp_config(cfg, self.gpu, ps.get_data_parallel_world_size())
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
        if ddp_cfg.overlap_grad_reduce:
            # As Megatron's own training loop does: the schedule holds the bucket reductions back until
            # the last micro-batch's backward (no_sync) and starts them as buckets fill; the reduction
            # is finished in finalize_model_grads.
            model.config.no_sync_func = self.model.no_sync
            model.config.grad_sync_func = self.model.start_grad_sync
        self.opt, self.sched = build_optimizer([self.model], cfg, on_gpu=self.gpu)
        if cfg.algorithm.kl_coef > 0:
            # Same layout and recompute as the policy; the reference only runs forward (no_grad), where
            # Megatron recomputes nothing, so this only keeps the two configs identical.
            self.ref_model = build_model(self.arch, self.dtype, use_te=self.use_te, sequence_parallel=sp,
                                         recompute=rc, on_gpu=self.gpu, fusions=fusions, moe=moe)
            load_hf_weights(self.ref_model, cfg.model.path, self.arch, use_te=self.use_te)
            self.ref_model.eval().requires_grad_(False)
        self.tp, self.pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        # MoE routing replay (R3): each micro-batch routed as the engines routed it (None: off or a dense model)
        self.replay = TrainerReplay.for_models(self.arch, moe.routing_replay, [self.model, self.ref_model], sp)
        return {"rank": self.rank, "dp_rank": self.dp_rank, "reporter": self.reporter, "use_te": self.use_te,
                "device": "cuda" if self.gpu else "cpu", "cpu_threads": torch.get_num_threads(),
                "kernels": self.kernels.line(), "fusions": fusions}

    @property
    def module(self):
        return self.model.module

    @property
    def sampling(self) -> Sampling:
        """The engines' sampling distribution: log-probs, ratios and entropy are all taken under it."""
        r = self.cfg.rollout
        return Sampling(r.temperature, r.top_p, r.top_k)

    # ------------------------------------------------------------------------------------ batching

    def _shard(self, items: list[dict]) -> list[SeqItem]:
        order = sorted(range(len(items)), key=lambda i: -(len(items[i]["prompt"]) + len(items[i]["response"])))
        mine = order[self.dp_rank::self.dp]
        out = [SeqItem(i, items[i]["prompt"], items[i]["response"], items[i].get("extras", {}),
                       items[i].get("mask")) for i in mine]
        if not out:  # fewer samples than replicas: run a fully masked row to keep collectives aligned
            keys = items[0].get("extras", {}).keys() if items else ()
            out = [SeqItem(-1, [0], [0], {k: [0.0] for k in keys}, [0.0])]
        return out

    def _microbatches(self, seq_items: list[SeqItem]):
        # sequence parallelism splits each micro-batch's sequence across the TP ranks
        multiple = self.tp if self.sequence_parallel else 1
        mbs = make_microbatches(seq_items, self.cfg.trainer.micro_batch_tokens, multiple)
        if self.arch.num_experts and self.dp > 1:
            mbs += self._expert_padding(len(mbs), seq_items, multiple)
        if self.gpu:
            for mb in mbs:
                for name in ("tokens", "position_ids", "labels", "loss_mask"):
                    setattr(mb, name, getattr(mb, name).cuda(non_blocking=True))
                mb.extras = {k: v.cuda(non_blocking=True) for k, v in mb.extras.items()}
        return mbs

    def _expert_padding(self, count: int, seq_items: list[SeqItem], multiple: int) -> list:
        """Fully masked micro-batches that bring this replica to the largest micro-batch count of any replica.

        Expert parallelism dispatches tokens between DP replicas inside every MoE layer (an all-to-all per
        layer and micro-batch), so all replicas must run the same number of micro-batches, which their own
        shards do not guarantee. A masked row adds nothing to the loss or the gradients."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        n = torch.tensor([count], device="cuda" if self.gpu else "cpu")
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        keys = seq_items[0].extras.keys() if seq_items else ()
        dummy = SeqItem(-1, [0], [0], {k: [0.0] for k in keys}, [0.0])
        return [make_microbatches([dummy], self.cfg.trainer.micro_batch_tokens, multiple)[0]
                for _ in range(int(n.item()) - count)]

    def _run(self, model, mbs, loss_fn, forward_only: bool, items: list[dict]) -> list[dict]:
        """One pass of Megatron's schedule over `mbs`; with routing replay on, each micro-batch's forward
        replays its items' engine routes (every pipeline stage its own layers), cleared when the pass ends."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        with replaying(self.replay, model, items) as before_forward:
            def forward_step(data_iterator, chunk):
                mb = next(data_iterator)
                if before_forward is not None:
                    before_forward(mb)
                return chunk(mb.tokens, mb.position_ids, None), partial(loss_fn, mb)

            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
                seq_length=max(mb.tokens.shape[1] for mb in mbs),
                micro_batch_size=max(mb.tokens.shape[0] for mb in mbs), forward_only=forward_only)

    # ----------------------------------------------------------------------------------- log-probs

    def logprobs(self, items: list[dict], reference: bool = False) -> dict[int, list[float]] | None:
        """Per-response-token log-probs of this rank's shard (reporters only; None elsewhere)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("no reference model (algorithm.kl_coef is 0)")
        mbs = self._microbatches(self._shard(items))
        vocab, sampling, chunk = self.arch.vocab_size, self.sampling, self.cfg.trainer.logprob_chunk_tokens

        def loss_fn(mb, logits):
            lp = token_logprobs(logits, mb.labels, vocab, sampling, chunk)
            return lp.sum() * 0.0, {"lp": lp.detach().cpu(), "mb": mb}

        model.eval()
        with torch.no_grad():
            out = self._run(model, mbs, loss_fn, forward_only=True, items=items)
        model.train()
        if not self.reporter:
            return None
        result = {}
        for rec in out:
            mb = rec["mb"]
            for row, (idx, (s, e)) in enumerate(zip(mb.indices, mb.response_slices)):
                if idx >= 0:
                    result[idx] = rec["lp"][row, s:e].tolist()
        return result

    # -------------------------------------------------------------------------------------- training

    def _global_counts(self, items: list[dict]) -> tuple[float, float]:
        tokens = sum(sum(it["mask"]) if it.get("mask") is not None else len(it["response"]) for it in items)
        return float(tokens), float(len(items))

    def _rl_loss(self, n_tok, n_seq, scale, mb, logits):
        a = self.cfg.algorithm
        # One chunked pass gives both: the entropy (a logged metric) costs one more reduction per chunk and no
        # memory; its backward only runs when entropy_coef puts it into the loss.
        lp, ent = token_logprobs_and_entropy(logits, mb.labels, self.arch.vocab_size, self.sampling,
                                             self.cfg.trainer.logprob_chunk_tokens)
        if a.entropy_coef == 0:
            ent = ent.detach()
        ex = mb.extras
        old = ex["old_logprobs"] if "old_logprobs" in ex else lp.detach()
        per_tok, terms = A.policy_loss_per_token(
            lp, old, ex.get("rollout_logprobs"), ex["advantages"], clip_low=a.clip_low, clip_high=a.clip_high,
            tis_cap=a.tis_cap, ref_logp=ex.get("ref_logprobs"), kl_coef=a.kl_coef, entropy=ent,
            entropy_coef=a.entropy_coef, clip_ratio_c=a.clip_ratio_c, log_ratio_clamp=a.log_ratio_clamp,
            mask=mb.loss_mask, mis_low=a.mis_low, mis_high=a.mis_high, icepop_beta=a.icepop_beta,
            seq_geo_band=a.seq_mask_geo_band, seq_token_band=a.seq_mask_token_band)
        w = A.token_weights(mb.loss_mask, a.loss_aggregation, n_tok, n_seq)
        loss = (per_tok * w).sum()
        sums = {k: (v.detach() * mb.loss_mask).sum() for k, v in terms.items()}
        sums.update(loss=loss.detach(), n_tokens=mb.loss_mask.sum(), ratio_max=(terms["ratio"] * mb.loss_mask).max())
        return loss * scale, sums

    def _sft_loss(self, n_tok, n_seq, scale, mb, logits):
        # Supervised targets: the model's own distribution, not the engines' sampling one.
        lp = token_logprobs(logits, mb.labels, self.arch.vocab_size,
                            chunk_tokens=self.cfg.trainer.logprob_chunk_tokens)
        w = A.token_weights(mb.loss_mask, "token", n_tok, n_seq)
        loss = -(lp * w).sum()
        return loss * scale, {"loss": loss.detach(), "n_tokens": mb.loss_mask.sum()}

    def _forward_backward(self, items: list[dict], kind: str, counts: tuple[float, float] | None = None,
                          sync: bool = True) -> dict[str, float]:
        """`sync=False` (a streamed part) leaves the gradients unreduced across DP; `stream_step` reduces the
        sum of all parts once (trainer/stream.py)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        n_tok, n_seq = counts or self._global_counts(items)  # stream training passes (1, 1)
        mbs = self._microbatches(self._shard(items))
        scale = len(mbs) * self.dp
        fn = self._rl_loss if kind == "rl" else self._sft_loss
        with self._grad_sync_deferred(not sync):  # trainer/stream.py
            out = self._run(self.model, mbs, partial(fn, n_tok, n_seq, scale), forward_only=False, items=items)
        if sync:
            finalize_model_grads([self.model])
        if not ps.is_pipeline_last_stage():
            return {}
        keys = [k for k in METRIC_KEYS if out and k in out[0]]
        vec = torch.stack([sum(rec[k] for rec in out).float() for k in keys]).cpu()
        top_keys = [k for k in MAX_KEYS if out and k in out[0]]
        top = torch.stack([torch.stack([rec[k].float() for rec in out]).max() for k in top_keys]).cpu() \
            if top_keys else torch.zeros(0)
        if self.dp > 1:
            dist.all_reduce(vec, group=ps.get_data_parallel_group(with_context_parallel=True))
            if top_keys:
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
        sums = dict(zip(keys, vec.tolist()))
        metrics = {"loss": sums["loss"], "n_tokens": sums["n_tokens"], **dict(zip(top_keys, top.tolist()))}
        for k in keys:
            if k not in ("loss", "n_tokens"):
                metrics[k] = sums[k] / max(sums["n_tokens"], 1.0)
        if self.replay:  # every rank made the same batch-wide choice (routing_replay.TrainerReplay)
            metrics["routing_replay/replayed"] = float(self.replay.replayed)
        return metrics

    def _broadcast_loss(self, metrics: dict) -> float:
        """The loss is known on the last stage only; every rank needs it for the finiteness check."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        t = torch.tensor([metrics.get("loss", 0.0)], device="cuda" if self.gpu else "cpu")
        if self.pp > 1:
            ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
            dist.broadcast(t, src=ranks[-1], group=ps.get_pipeline_model_parallel_group())
        return float(t.item())

    def train_step(self, items: list[dict], kind: str = "rl", advance_schedule: bool = True) -> dict[str, float]:
        """Forward/backward over all items, then one optimizer update (skipped if anything is non-finite).
        `advance_schedule=False`: a later mini-batch of the same harvest keeps the harvest's learning rate."""
        self.model.train()
        metrics = self._forward_backward(items, kind)
        return self._update(metrics, kind, advance_schedule)

    def _update(self, metrics: dict[str, float], kind: str, advance_schedule: bool = True) -> dict[str, float]:
        """One optimizer update from the accumulated gradients (skipped if anything is non-finite); shared by
        `train_step` and the stream trainer's `stream_step`."""
        from megatron_sortedrl.trainer.optimizer import optimizer_step

        loss = self._broadcast_loss(metrics)
        lr = self.cfg.trainer.warmup_sft_lr if kind == "sft" else None
        stepped = optimizer_step(self.opt, self.sched, [self.model], loss, grad_clip=self.cfg.trainer.grad_clip,
                                 on_gpu=self.gpu, lr_override=lr, advance_schedule=advance_schedule)
        if stepped["skipped"]:
            self.skipped_steps += 1
        elif kind == "rl":
            self.step += 1
        metrics.update(stepped, skipped_total=float(self.skipped_steps), step=float(self.step))
        trim_host_heap()  # nothing of the step is live now
        return metrics if self.reporter else {}

    def loss_and_grads(self, items: list[dict], kind: str = "rl") -> dict:
        """Loss and full HF-layout gradients without an update (parity tests and debugging)."""
        from megatron_sortedrl.trainer.optimizer import zero_grads
        from megatron_sortedrl.trainer.weights import export_hf_weights

        metrics = self._forward_backward(items, kind)
        grads = {n: p.main_grad for n, p in self.module.named_parameters()}
        full = {n: t.clone().cpu() for n, t in export_hf_weights(self.module, self.arch, use_te=self.use_te,
                                                                    tensors=grads, dtype=torch.float32)}
        zero_grads(self.opt, [self.model])
        return {"metrics": metrics, "grads": full} if self.rank == 0 or self.reporter else {}

    # ----------------------------------------------------------------------------- weights and state

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model as {HF name: tensor} on rank 0 (tests and small models; weight sync uses
        `push_weights`). The other ranks take part in the collective but keep nothing."""
        from megatron_sortedrl.trainer.weights import export_hf_weights

        out = {}
        for n, t in export_hf_weights(self.module, self.arch, use_te=self.use_te):
            if self.rank == 0:
                out[n] = t.cpu().clone()
        return out if self.rank == 0 else None

    def export_hf(self, out_dir: str, dtype: str | None = None) -> str | None:
        from megatron_sortedrl.trainer.hf_files import write_hf_dir
        from megatron_sortedrl.trainer.weights import export_hf_weights

        tensors = export_hf_weights(self.module, self.arch, use_te=self.use_te,
                                    dtype=getattr(torch, dtype) if dtype else None)
        if self.rank == 0:
            return write_hf_dir(out_dir, tensors, self.cfg.model.path)
        for _ in tensors:  # every rank takes part in the collective
            pass
        return None

    def save(self, path: str, extra: dict | None = None) -> str:
        from megatron_sortedrl.trainer.checkpoint import save_checkpoint

        state = {"step": self.step, "skipped_steps": self.skipped_steps, "extra": extra or {}}
        meta = {"step": self.step, "tp": self.tp, "pp": self.pp, "dp": self.dp, "model_type": self.arch.model_type}
        return str(save_checkpoint(path, self.module, self.opt, self.sched, state, meta))

    def reset_optimizer(self) -> int:
        return reset_state(self.opt)

    def load(self, path: str, load_optimizer: bool = True) -> dict:
        from megatron_sortedrl.trainer.checkpoint import load_checkpoint

        state = load_checkpoint(path, self.module, self.opt, self.sched, load_optimizer=load_optimizer)
        self.step, self.skipped_steps = state.get("step", 0), state.get("skipped_steps", 0)
        return state.get("extra", {})

    def shutdown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
