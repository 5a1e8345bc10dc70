"""`TrainerGroup`: the Megatron policy trainer as the RL driver sees it (one Ray actor per rank).

    group = TrainerGroup(cfg)                              # cfg: RunConfig; model at cfg.model.path
    logps = group.compute_logprobs(samples)                # list[list[float]], one per response token
    metrics = group.train_step(samples)                    # advantages from sample.reward (cfg.algorithm)
    metrics = group.sft_step([(prompt_tokens, target_tokens), ...])
    group.save_checkpoint("runs/x/checkpoints/iter_0000010", extra={...}); extra = group.load_checkpoint(path)
    path = group.export_hf_weights("runs/x/weights/v10")   # HF model directory (checkpoint export)
    group.push_weights(engine_actors, bucket_bytes=...)    # weight sync, driven by RolloutPool.sync_weights
    group.shutdown()

The group starts a local Ray instance when none is running (and stops it in `shutdown`), reserves one
placement-group bundle per TP group (TP CPUs, or TP GPUs + TP CPUs with `cluster.device=gpu`, pinned to
the layout's trainer nodes when `cluster.gpus_per_node` is declared; see `megatron_sortedrl.placement`),
starts rank r in the bundle of TP group r // TP in node order, checks that every TP group reports one node,
asks rank 0's actor for its address and a free port, and passes both to every rank, which then forms the
`torch.distributed` world (gloo on CPU, NCCL on GPU) and Megatron's TP x PP x DP groups. Each of these
waits is bounded by `cluster.startup_timeout_s`. Every method fans out to all ranks and returns the
reporting rank's answer; ranks are never addressed individually.

Samples travel as small dicts (tokens and per-token floats), not as `Sample` objects.

With `cluster.colocate` the bundles are blocks of devices shared with the engines (`colocate/placement.py`):
each rank asks for a GPU fraction, and the group lends its reservation to the rollout pool (`shared_placement`);
`offload_state` / `reload_state` move every rank's state to host memory and back (`trainer/offload.py`).

Deliberately left out: restarting dead actors (a failed rank raises in the driver; restart from the last
checkpoint).
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_sortedrl import algorithms as A
from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.sample import Sample
from megatron_sortedrl.trainer.checkpoint import find_latest_checkpoint
from megatron_sortedrl.trainer.model import read_hf_config
from megatron_sortedrl.trainer.worker import TrainerWorker, on_gpu


_CHANGES_WEIGHTS = ("train_step", "load", "stream_step")  # methods after which the weights differ from the last push


def _use_rollout(samples: list[Sample], cfg) -> bool:
    """The rollout log-probs go to the trainer (mismatch metrics always, corrections as `algorithm.*` sets) only
    when every sample has them (a batch-wide choice)."""
    with_rollout = [bool(s.response_tokens) and len(s.rollout_logprobs) == len(s.response_tokens) for s in samples]
    return all(with_rollout)


def _with_routes(item: dict, sample: Sample, cfg) -> dict:
    """Routing replay: the sample's engine routes (`RoutedExperts`, one row per input position, or None) ride with
    its item to the ranks, which hand them to `trainer/routing_replay.py` per micro-batch."""
    if cfg.algorithm.routing_replay:
        item["routes"] = sample.routed_experts
    return item


def _summed(outs: list[dict]) -> dict:
    return {"bytes": sum(o["bytes"] for o in outs), "seconds": max(o["seconds"] for o in outs),
            # GPU: the largest rank's allocation, the tightest device's free memory
            **({k: pick(o[k] for o in outs) for k, pick in (("device_allocated", max), ("device_free", min))
                if k in outs[0]})}


_SUMMED = ("n_tokens", "skipped")  # over a harvest's optimizer steps; `ratio_max`, `grad_norm_max`: the largest
_LAST = ("step", "skipped_total")  # counters: the value after the last step


def merge_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one harvest's optimizer steps as one row: token-weighted means of the per-token terms
    (each step's are means over its own tokens), sums of counts, the largest ratio and gradient norm, the
    learning rate of the first step, and `optimizer_steps`. One step: its own metrics, plus the count."""
    if len(steps) == 1:
        return {**steps[0], "optimizer_steps": 1.0, "grad_norm_max": steps[0].get("grad_norm", float("nan"))}
    out: dict[str, float] = {"optimizer_steps": float(len(steps))}
    weights = [max(st.get("n_tokens", 1.0), 1.0) for st in steps]
    for key in steps[0]:
        vals = [st[key] for st in steps if key in st]
        if key in _SUMMED:
            out[key] = float(sum(vals))
        elif key in _LAST:
            out[key] = vals[-1]
        elif key == "ratio_max":
            out[key] = max(vals)
        elif key == "lr":
            out[key] = vals[0]
        elif key in ("grad_norm", "loss"):
            out[key] = sum(vals) / len(vals)  # per step: the mean step's
        else:
            w = [wt for st, wt in zip(steps, weights) if key in st]
            out[key] = sum(v * x for v, x in zip(vals, w)) / sum(w)
    norms = [st["grad_norm"] for st in steps if "grad_norm" in st]
    if norms:
        out["grad_norm_max"] = max(norms)
    return out


class TrainerActor:
    """Ray actor body: holds one `TrainerWorker` and forwards calls to it."""

    def __init__(self, cfg, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.worker: TrainerWorker | None = None

    def node_id(self) -> str:
        from megatron_sortedrl.placement import node_id

        return node_id()

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]

    def address(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict:
        self.worker = TrainerWorker(self.cfg, self.rank, self.world_size, master_addr, master_port)
        return self.worker.setup()

    def call(self, method: str, *args, **kwargs):
        from megatron_sortedrl.trainer import cpu_compat

        if not self.worker.gpu:
            cpu_compat.activate()  # the mode is per thread; Ray may run a call on another thread
        return getattr(self.worker, method)(*args, **kwargs)


class TrainerGroup:
    def __init__(self, cfg, *, num_cpus_per_rank: float = 1.0):
        import ray

        from megatron_sortedrl import placement as P

        cfg = copy.deepcopy(cfg)
        # Ray workers need not share the driver's working directory: send absolute paths only.
        cfg.model.path = str(Path(cfg.model.path).resolve())
        arch = read_hf_config(cfg.model.path, cfg.model.rope_scaling)  # fail fast, before any actor starts
        cfg.validate_model_shape(arch.num_heads, arch.num_kv_heads, arch.num_layers)
        self.cfg = cfg
        self.world_size = cfg.parallel.world_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=cfg.cluster.ray_address or "local", include_dashboard=False,
                     num_cpus=None if cfg.cluster.ray_address else max(int(self.world_size * num_cpus_per_rank), 1))
        gpu = on_gpu(cfg)
        p, timeout = cfg.parallel, cfg.cluster.startup_timeout_s
        tp = p.tensor_model_parallel_size
        layout = f"TP={tp} x PP={p.pipeline_model_parallel_size} x DP={p.data_parallel_size}"
        self.actors = []
        # colocated (colocate/placement.py): blocks of devices shared with the engines, a GPU fraction per rank
        group, gpus, bundles = tp, (1 if gpu else 0), None
        if cfg.cluster.colocate:
            from megatron_sortedrl.colocate.placement import TRAINER_GPU_SHARE, block_size, colocated_bundles

            group, gpus = block_size(cfg), (TRAINER_GPU_SHARE if gpu else 0)
            bundles = colocated_bundles(cfg, gpu=gpu, cpus_per_rank=num_cpus_per_rank)
        try:
            self._placement = P.reserve(bundles or
                P.trainer_bundles(self.world_size, tp, gpu=gpu, cpus_per_rank=num_cpus_per_rank,
                                  gpus_per_node=cfg.cluster.gpus_per_node), f"trainer ({layout})", timeout)
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
            raise
        try:
            self.actors, self.rank_nodes = P.start_group(
                ray.remote(TrainerActor), lambda r: (cfg, r, self.world_size), self._placement, group, "trainer",
                timeout, layout=layout, num_cpus=num_cpus_per_rank, num_gpus=gpus,
                runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
            addr, port = P.wait_ready([self.actors[0].address.remote()], "trainer rank 0 address", timeout)[0]
            self.info = P.wait_ready([a.setup.remote(addr, port) for a in self.actors], "trainer set-up", timeout,
                                     labels=[f"rank {r}" for r in range(self.world_size)])
        except BaseException:
            self._release()  # no half-started group left behind holding CPUs/GPUs
            raise
        self.shared_placement = None  # colocated: lent to the rollout pool (colocate/lifecycle.start_engines)
        if cfg.cluster.colocate:
            from megatron_sortedrl.colocate.placement import SharedPlacement

            ids = P.wait_ready([a.gpu_ids.remote() for a in self.actors], "trainer GPU ids", timeout)
            self.shared_placement = SharedPlacement(self._placement, group, ids)
        self.reporters = [i["rank"] for i in self.info if i["reporter"]]
        self.first_reporter = min(i["rank"] for i in self.info if i["reporter"] and i["dp_rank"] == 0)

    # ---------------------------------------------------------------------------------------- plumbing

    def _all(self, method: str, *args, **kwargs) -> list:
        import ray

        return ray.get(self._submit(method, *args, **kwargs))

    def _submit(self, method: str, *args, **kwargs) -> list:
        """Starts `method` on every rank and returns the Ray futures at once (each actor runs its calls in
        order, so a later `_all` sees this call's effect)."""
        if method in _CHANGES_WEIGHTS:
            self._epoch = self.weights_epoch + 1
        return [a.call.remote(method, *args, **kwargs) for a in self.actors]

    @staticmethod
    def _item(prompt: Sequence[int], response: Sequence[int], extras: dict | None = None, mask=None) -> dict:
        return {"prompt": list(prompt), "response": list(response), "extras": extras or {}, "mask": mask}

    # ---------------------------------------------------------------------------------------- log-probs

    def compute_logprobs(self, samples: list[Sample], reference: bool = False) -> list[list[float]]:
        """Per-response-token log-probs under the current policy (or the frozen reference)."""
        items = [_with_routes(self._item(s.prompt_tokens, s.response_tokens), s, self.cfg) for s in samples]
        merged: dict[int, list[float]] = {}
        for out in self._all("logprobs", items, reference):
            if out:
                merged.update(out)
        return [merged[i] for i in range(len(samples))]

    # ---------------------------------------------------------------------------------------- training

    def advantages(self, samples: list[Sample]) -> list[float]:
        """One advantage per sample from `sample.reward`, grouped by prompt id (cfg.algorithm.advantage)."""
        if any(s.reward is None for s in samples):
            raise ValueError("every sample needs a reward before its advantage can be computed")
        a = self.cfg.algorithm
        rewards = torch.tensor([float(s.reward) for s in samples])
        groups = [(s.prompt_id, s.epoch) for s in samples]
        lengths = torch.tensor([s.generated_length for s in samples])  # trained tokens: tool tokens are masked
        return A.compute_advantages(rewards, groups, a.advantage, lengths=lengths,
                                    normalize_std=a.normalize_advantage_std).tolist()

    def _rl_decisions(self, samples: list[Sample], advantages: Sequence) -> list[tuple]:
        """What each sample is trained with besides its tokens (advantage, loss mask, TIS): a streamed part is
        exact only if these equal the batch's (`DriverStream.train` compares them)."""
        tis = _use_rollout(samples, self.cfg)
        return [(tuple(a) if isinstance(a, (list, tuple)) else float(a), bool(s.meta.get("loss_masked")), tis)
                for s, a in zip(samples, advantages)]

    def _rl_items(self, samples, advantages, old_logprobs) -> list[dict]:
        if advantages is None:
            advantages = self.advantages(samples)
        use_rollout = _use_rollout(samples, self.cfg)
        ref = self.compute_logprobs(samples, reference=True) if self.cfg.algorithm.kl_coef > 0 else None
        items = []
        for i, s in enumerate(samples):
            n = len(s.response_tokens)
            adv = advantages[i]
            ex = {"advantages": list(adv) if isinstance(adv, (list, tuple)) else [float(adv)] * n}
            if use_rollout:
                # Per-token behaviour log-probs: tokens of a resumed partial rollout carry the log-prob of
                # the policy version that sampled them, so TIS corrects staleness as well as engine mismatch.
                ex["rollout_logprobs"] = list(s.rollout_logprobs)
            if old_logprobs is not None:
                ex["old_logprobs"] = list(old_logprobs[i])
            if ref is not None:
                ex["ref_logprobs"] = ref[i]
            # Overlong filtering (scheduler/selective.py) masks a truncated response out of the loss entirely; a
            # trajectory's tool tokens (not sampled, placeholder log-probs) are masked always (Sample.loss_mask).
            items.append(_with_routes(
                self._item(s.prompt_tokens, s.response_tokens, ex, [0.0] * n if s.meta.get("loss_masked")
                           else s.loss_mask()), s, self.cfg))
        return items

    def _report(self, outs: list) -> dict:
        return outs[self.first_reporter]

    def train_minibatches(self, minibatches: list[list[Sample]], advantages: Sequence,
                          epochs: int = 1) -> dict[str, float]:
        """One optimizer step per mini-batch (`megatron_sortedrl/minibatch.py`), `epochs` passes, on a harvest's
        samples. `advantages`: per sample of the flattened mini-batches, computed once for the harvest. The old
        (proximal) log-probs are taken once, under the weights before the first step, and held fixed; with a
        single mini-batch and one epoch they are left to the step itself, which is exactly `train_step` (the
        proximal policy is then the current one). The learning-rate schedule advances on the first step only.
        Returns the steps' metrics merged (`merge_step_metrics`) and `optimizer_steps`."""
        flat = [s for mb in minibatches for s in mb]
        if len(advantages) != len(flat):
            raise ValueError(f"{len(advantages)} advantages for {len(flat)} samples")
        old = self.compute_logprobs(flat) if len(minibatches) > 1 or epochs > 1 else None
        bounds, start = [], 0
        for mb in minibatches:
            bounds.append((start, start + len(mb)))
            start += len(mb)
        steps = []
        for _ in range(epochs):
            for mb, (a, b) in zip(minibatches, bounds):
                items = self._rl_items(mb, list(advantages[a:b]), old[a:b] if old is not None else None)
                steps.append(dict(self._report(self._all("train_step", items, "rl", not steps))))
        metrics = merge_step_metrics(steps)
        rewards = [s.reward for s in flat if s.reward is not None]
        if rewards:
            metrics["reward_mean"] = float(sum(rewards) / len(rewards))
        return metrics

    def train_step(self, samples: list[Sample], advantages: Sequence | None = None,
                   old_logprobs: list[list[float]] | None = None) -> dict[str, float]:
        """One policy update on `samples`. `advantages`: one float (or one list per token) per sample;
        None computes them from rewards. `old_logprobs`: the proximal policy's per-token log-probs; None
        uses the current policy (exact for one update per batch). Returns metrics (loss, pg_loss, kl,
        entropy, clip_frac, tis_weight, grad_norm, lr, skipped, skipped_total, step, ...)."""
        items = self._rl_items(samples, advantages, old_logprobs)
        metrics = dict(self._report(self._all("train_step", items, "rl")))
        rewards = [s.reward for s in samples if s.reward is not None]
        if rewards:
            metrics["reward_mean"] = float(sum(rewards) / len(rewards))
        return metrics

    def sft_step(self, pairs: list[tuple]) -> dict[str, float]:
        """Supervised step (lr = trainer.warmup_sft_lr): cross-entropy on target tokens given the prompt.
        A pair may carry a third entry, a per-target-token loss mask (a worked trajectory's tool tokens: 0)."""
        items = [self._item(p[0], p[1], None, list(p[2]) if len(p) > 2 else None) for p in pairs]
        return dict(self._report(self._all("train_step", items, "sft")))

    def reset_optimizer(self) -> int:
        """Forgets the optimizer's moments (trainer/optimizer.py, `reset_state`): RL after the warm start
        starts from a fresh Adam, as after a separate supervised job. Returns rank 0's dropped states."""
        return self._all("reset_optimizer")[0]

    def loss_and_grads(self, samples: list[Sample], advantages: Sequence | None = None) -> dict:
        """RL loss metrics and full HF-layout gradients, without an update (tests, debugging)."""
        items = self._rl_items(samples, advantages, None)
        outs = self._all("loss_and_grads", items, "rl")
        return {"metrics": outs[self.first_reporter]["metrics"], "grads": outs[0]["grads"]}

    # ------------------------------------------------------------------------------ weights and state

    def export_hf_weights(self, out_dir: str | Path | None = None, dtype: str | None = None):
        """With `out_dir`: writes a HF model directory there (atomically) and returns its path. Without:
        returns {HF name: full tensor} from rank 0 (tests and small models; weight sync uses `push_weights`)."""
        if out_dir is None:
            return self._all("hf_state_dict")[0]
        return self._all("export_hf", str(Path(out_dir).resolve()), dtype)[0]

    @property
    def weights_epoch(self) -> int:
        """Counts calls that may change the weights, so a pool replaying a push can tell it is still current."""
        return getattr(self, "_epoch", 0)

    def push_weights(self, engines: list, *, bucket_bytes: int, max_buckets_in_flight: int = 2,
                     transport: str = "object_store", nccl: dict | None = None, mode: str = "pipelined") -> dict:
        """Sends the weights straight from the trainer to the rollout engine actors `engines` (Ray handles).

        One sender per pipeline stage (TP rank 0 of DP replica 0) gathers its stage's shards and sends
        packed buckets to every engine (see `rollout.weight_sync`); nothing comes back through the caller.
        The engines must be inside `begin_weight_update`. Returns summed counts and one entry per sender.
        `transport="nccl"` (GPU): the senders and the engines' GPUs form NCCL groups, set up here on the
        first push to a set of engines (those of an earlier set are destroyed first). `mode`: "pipelined"
        (every stage its own group, the engines receive the whole sync in one call) or "serial" (the path
        before: one group, bucket after bucket, a Ray round trip each; kept to compare)."""
        import ray

        plan_info, init_refs, recv_refs = None, [], []
        if transport == "nccl":
            plan_info = self._nccl_setup(engines, bucket_bytes, mode)
            init_refs = plan_info.pop("init_refs", [])
            if mode == "pipelined":  # the engines post their receives for the whole sync at once
                recv_refs = [e.rpc.remote("msrl_nccl_receive_stages", (plan_info["stage_plans"],)) for e in engines]
        outs = [o for o in self._all("push_weights", engines, bucket_bytes, max_buckets_in_flight, transport,
                                     plan_info, mode) if o]
        ray.get(init_refs)
        total = sum(o["num_tensors"] for o in outs)
        for counts in ray.get(recv_refs):
            if any(c != total for c in counts):
                raise RuntimeError(f"engine workers received {counts} tensors of {total}")
        return {"num_tensors": total, "bytes": sum(o["bytes"] for o in outs),
                "num_buckets": sum(o["num_buckets"] for o in outs), "senders": outs}

    def _nccl_setup(self, engines: list, bucket_bytes: int, mode: str = "pipelined") -> dict:
        import ray

        from megatron_sortedrl.rollout.weight_sync_gpu import nccl_ranks

        key = (mode, tuple(a._actor_id.hex() for a in engines))
        if mode == "pipelined":
            metas = self._all("weight_bucket_metas", bucket_bytes)
            info: dict = {"stage_plans": [m for m in metas if m is not None]}
            if getattr(self, "_nccl_engines", None) != key:
                self._all("nccl_close")  # the groups of the engines a relayout replaced go first
                senders = [a for a, m in zip(self.actors, metas) if m is not None]  # stage order
                tps = [w.tp for w in ray.get([a.load.remote() for a in engines])]
                _, offsets = nccl_ranks(0, tps)
                endpoints = ray.get([a.call.remote("address") for a in senders])
                self._nccl_rdv = {"endpoints": endpoints, "stage_world_size": 1 + sum(tps)}
                info["init_refs"] = [a.rpc.remote("msrl_nccl_init_stages", (endpoints, off, 1 + sum(tps)))
                                     for a, off in zip(engines, offsets)]
                self._nccl_engines = key
            info.update(self._nccl_rdv)
            return info
        plans = [p for p in self._all("weight_bucket_plan", bucket_bytes) if p is not None]
        senders = len(plans)  # one per stage, in stage order (rank order is stage-major for TP rank 0, DP 0)
        plan = [(stage, n) for stage, sizes in enumerate(plans) for n in sizes]
        info = {"plan": plan}
        if getattr(self, "_nccl_engines", None) != key:
            self._all("nccl_close")
            tps = ray.get([a.load.remote() for a in engines])
            world, offsets = nccl_ranks(senders, [w.tp for w in tps])
            addr, port = ray.get(self.actors[0].address.remote())  # rank 0 is stage 0's sender: it hosts the store
            self._nccl_rdv = {"master_address": addr, "master_port": port, "world_size": world}
            # Both sides block in the rendezvous: the engines' half is started before the senders' push.
            info["init_refs"] = [a.nccl_init.remote(addr, port, off, world) for a, off in zip(engines, offsets)]
            self._nccl_engines = key
        info.update(self._nccl_rdv)
        return info

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> str:
        """Atomic torch_dist checkpoint of model + optimizer + trainer state; `extra` (driver resume state,
        picklable) comes back from `load_checkpoint`."""
        return self._all("save", str(Path(path).resolve()), extra)[0]

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> dict:
        """Loads a checkpoint saved at any TP/PP; raises CheckpointError for a missing or incomplete one."""
        if path is None:
            raise CheckpointError("no checkpoint to load (latest_checkpoint found none)")
        return self._all("load", str(Path(path).resolve()), load_optimizer)[0]

    def offload_state(self) -> dict:
        """Colocated layout: every rank's parameters, gradients and optimizer state to host memory
        (`trainer/offload.py`); returns the bytes moved over all ranks, the slowest rank's seconds and the
        device memory still allocated on the rank holding the most."""
        return _summed(self._all("offload_state"))

    def reload_state(self) -> dict:
        """The state `offload_state` moved away, back on every rank's device; same figures."""
        return _summed(self._all("reload_state"))

    @staticmethod
    def latest_checkpoint(root: str | Path) -> Path | None:
        return find_latest_checkpoint(root)

    def shutdown(self) -> None:
        if not self.actors:
            return
        try:
            self._all("shutdown")
        finally:
            self._release()

    def _release(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        self._placement.release()
        if self._owns_ray:
            ray.shutdown()
