"""Rollout: vLLM engines as Ray actors, streaming and abort, weight sync, elastic layouts, failure handling.

    from megatron_sortedrl.rollout import RolloutPool, PoolOptions, GenRequest, Completion

See docs/rollout.md. Importing this package does not import vLLM; the engine actors do.
"""

from megatron_sortedrl.rollout.pool import RolloutPool, WorkerUnavailable
from megatron_sortedrl.rollout.pool_options import PoolOptions, speculative_config_from
from megatron_sortedrl.rollout.types import Completion, GenRequest, SyncReport, WorkerLoad
from megatron_sortedrl.rollout.weight_sync import iter_buckets, iter_source

__all__ = ["Completion", "GenRequest", "PoolOptions", "RolloutPool", "SyncReport", "WorkerLoad", "WorkerUnavailable",
           "iter_buckets", "iter_source", "speculative_config_from"]
