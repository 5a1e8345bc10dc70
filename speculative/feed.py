"""Driver-side HistoSpec plumbing: record responses as they finish, ship them to the engines' drafters,
and turn the engines' counters into per-step metrics (per round kind).

    feed = HistoryFeed(cfg.speculative, pool)     # owns the HistoryStore (feed.store)
    feed.on_finished(sample)                      # rollout: a response finished (siblings may still run)
    feed.maybe_ship()                             # rollout loop: ships (without waiting) if something new arrived
    metrics = feed.end_step(batch, kind="long")   # after the step: records the batch, ships, reads counters

Sibling drafts: the n samples of a prompt run at the same time and finish at different times. With
`sibling_drafts` each finished response is recorded at once (same epoch: it joins the prompt's history)
and shipped at most every `sibling_ship_interval_s`, so the siblings still running (the long tail) draft
from the freshest responses there are. These shipments do not block the driver: it sends one and goes on
(completions, rewards, harvest), and reads the engines' answers before it sends the next. A sample is
recorded once, whether it is seen finishing or only in the trained batch (carried partial rollouts, runs
without sibling drafts).

Shipping is idempotent and self-healing: every engine answers the history version it holds; when one
holds another version than the store shipped (an engine restarted, a new layout), everyone gets a full
snapshot and the drafter settings again (`histospec_configure`), which is also how the config's drafter
settings reach the engines in the first place.

Metrics: HistoSpec's proposer counters (summed over engines, TP rank 0 each) give the `spec/*` figures
since the start of the run (as before). vLLM's own counters (`EngineWorker.spec_counters`, any method, so
`ngram`/`suffix` are measured the same way) give, as differences, the step's figures under `spec/step/*`
(`tokens`, `target_forwards`, `tokens_per_forward`, `acceptance_rate`, `mean_accepted_length`), plus the
proposer's drafter time of the step and `spec/round_long` (1.0 for a long round) to split by round kind.
The `spec/step/*` figures and `spec/round_long` are logged without speculation too (tokens per forward
1.0), so a run without speculation is the baseline of one with it.
Plain rounds: with `speculative.min_history_share` > 0 a round whose prompts mostly lack history runs on
plain engines (`megatron_sortedrl.relayout.apply_speculation`); nothing is shipped to them, and the switch to
HistoSpec engines ships the settings and the whole history (`engines_replaced`).
Left out: pushing history to engines of other methods (ngram/suffix answer "inactive" and are skipped).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from speculative.fast_path import RoundEngineSwitch
from speculative.history import HistoryStore, split_turns
from speculative.metrics import summarize

log = logging.getLogger(__name__)
COUNTERS = ("steps", "forwards", "tokens", "verified_draft_tokens", "accepted_tokens", "drafts", "draft_tokens",
            "drafter_s")


def settings_of(cfg) -> dict[str, Any]:
    """The drafter settings (`DraftSettings` fields) that a `SpeculativeConfig` sets."""
    return {"match_tokens": cfg.match_tokens, "min_draft_tokens": cfg.min_draft_tokens,
            "max_draft_tokens": cfg.max_draft_tokens, "min_confidence": cfg.min_confidence,
            "adaptive_length": cfg.adaptive_draft_length,
            "epoch_weight": cfg.history_epoch_weight, "sources": list(cfg.sources),
            "max_batch_rows": cfg.max_batch_rows, "step_draft_budget": cfg.step_draft_budget,
            "cost_gate": cfg.cost_gate}


class HistoryFeed:
    def __init__(self, cfg, pool: Any, turn_marker: Iterable[int] = ()) -> None:
        self.cfg = cfg
        # Tokens that end every rendered tool message (ToolRenderer.turn_marker); with it the drafters align a
        # trajectory's turns with the previous epoch's (speculative/drafter.py). (): no tools, one turn.
        self.turn_marker = [int(t) for t in turn_marker]
        self.pool = pool
        self.store = HistoryStore(max_prompts=cfg.history_max_prompts, max_responses_per_prompt=cfg.history_max_responses,
                                  keep_epochs=cfg.history_epochs)
        self.active = bool(cfg.enabled and cfg.method == "histospec")
        self.shipped = 0
        self._configured = False
        self._recorded: dict[str, None] = {}  # sample ids recorded while finishing, not yet seen in a batch
        self._last_ship = 0.0
        self._inflight: tuple[list[Any], int] | None = None  # (call references, version) of an unanswered shipment
        self._resend = False  # the next shipment sends the full history (a shipment was lost)
        self._before: dict[str, float] = {}
        self.ship_s = 0.0  # driver time spent shipping (reported per step)
        self.shipments = 0
        self._by_kind: dict[str, list[float]] = {}  # "short"/"long" -> [tokens, target forwards] this run
        self.switch = RoundEngineSwitch(cfg)  # plain engines for rounds without history (speculative/fast_path.py)

    # -- recording ----------------------------------------------------------------------------------
    def _record(self, s: Any) -> None:
        if not s.response_tokens:
            return
        spans = getattr(s, "tool_spans", None)
        if spans:  # a trajectory: its generated turns, tool tokens cut out (they are never drafted)
            tokens, lens = split_turns(s.response_tokens, spans)
            self.store.record(s.prompt_tokens, [tokens], epoch=s.epoch, turn_lens=[lens])
        else:
            self.store.record(s.prompt_tokens, [s.response_tokens], epoch=s.epoch)

    def on_finished(self, s: Any) -> None:
        if self.active and self.cfg.sibling_drafts and s.sample_id not in self._recorded:
            self._record(s)
            self._recorded[s.sample_id] = None
            while len(self._recorded) > 1_000_000:  # never seen in a batch (dropped samples): forget the oldest
                self._recorded.pop(next(iter(self._recorded)))

    def record_batch(self, batch: Iterable[Any]) -> None:
        for s in batch:
            if self._recorded.pop(s.sample_id, 0) is None:
                continue  # already recorded when it finished
            self._record(s)

    # -- shipping -----------------------------------------------------------------------------------
    def maybe_ship(self) -> None:
        """During a round: ships what finished since the last shipment without waiting for the engines (they
        apply it between two steps). At most one such shipment is in flight; while it is, this returns."""
        if (self.active and self.cfg.sibling_drafts and self.store.version != self.shipped
                and time.monotonic() - self._last_ship >= self.cfg.sibling_ship_interval_s
                and self._settle(block=False)):
            self.ship(wait=False)

    def ship(self, full: bool = False, wait: bool = True) -> None:
        """Sends what changed since the last shipment (everything when `full`) to every engine. With `wait`
        false (and a pool that can) the call returns once sent; `_settle` reads the engines' answers later."""
        if not self.active or self.plain_engines():
            return  # plain engines have no drafter; the switch to HistoSpec engines ships everything
        t0 = time.monotonic()
        self._settle(block=True)  # one shipment at a time: the engines apply them in order
        if not self._configured:
            self.pool.collective_rpc("histospec_configure", **settings_of(self.cfg), turn_marker=self.turn_marker)
            self._configured = True
        full, self._resend = full or self._resend, False
        delta = self.store.snapshot() if full else self.store.updates_since(self.shipped)
        if wait or not hasattr(self.pool, "collective_rpc_async"):
            self._check(self.pool.collective_rpc("histospec_update", delta.to_bytes()), delta.version, full)
        else:
            self._inflight = (self.pool.collective_rpc_async("histospec_update", delta.to_bytes()), delta.version)
        self.shipped = delta.version
        self._last_ship = time.monotonic()
        self.ship_s += self._last_ship - t0
        self.shipments += 1

    def _settle(self, block: bool) -> bool:
        """Reads the answers of the shipment in flight, if any. False while it is still being applied (only
        without `block`)."""
        if self._inflight is None:
            return True
        refs, version = self._inflight
        try:
            answers = self.pool.rpc_results(refs, timeout=None if block else 0.0)
        except Exception as exc:  # an engine died meanwhile: the pool restarts it; everyone gets everything again
            log.warning("a history shipment was not answered (%s); the next one sends the full history", exc)
            self._inflight, self._configured, self._resend = None, False, True
            return True
        if answers is None:
            return False
        self._inflight = None
        self._check(answers, version, False)
        return True

    def _check(self, answers: list[list[Any]], version: int, full: bool) -> None:
        """Every engine must now hold `version`; one that holds another (it restarted, or is new) missed
        earlier shipments: every engine gets the settings and a full snapshot again."""
        active = [a for per in answers for a in per if isinstance(a, dict) and a.get("active")]
        if not full and any(a.get("version") != version for a in active):
            self.pool.collective_rpc("histospec_configure", **settings_of(self.cfg), turn_marker=self.turn_marker)
            self.pool.collective_rpc("histospec_update", self.store.snapshot().to_bytes())

    def reset_engines(self) -> None:
        """After a resume or an engine restart: the next shipment configures and sends everything."""
        self._configured, self._inflight = False, None  # (an unanswered shipment no longer matters)
        self.ship(full=True)

    def plain_engines(self) -> bool:
        """Whether the round switch has the engines plain now (no speculative config)."""
        return self.switch.active and getattr(getattr(self.pool, "opts", None), "speculative_config", 1) is None

    def engines_replaced(self) -> None:
        """New engines (a switch between plain and HistoSpec engines): their proposer counters start at zero,
        and their drafters get the settings and the whole history (nothing to ship to plain engines)."""
        self._before = {k: v for k, v in self._before.items() if k.startswith("vllm_")}
        self._configured, self._inflight = False, None
        if self.pool.opts.speculative_config is not None:
            self.ship(full=True)

    # -- metrics ------------------------------------------------------------------------------------
    def _engine_stats(self) -> list[dict[str, Any]]:
        """`histospec_stats` of every engine (its first active TP rank; {} for an engine without HistoSpec)."""
        return [next((r for r in per if isinstance(r, dict) and r.get("active")), None) or {}
                for per in self.pool.collective_rpc("histospec_stats")]

    def counters(self) -> dict[str, float]:
        """Cumulative proposer counters summed over engines (first TP rank of each)."""
        out: dict[str, float] = {}
        for stats in self._engine_stats():
            for k, v in stats.get("totals", {}).items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def vllm_counters(self) -> dict[str, float]:
        """vLLM's cumulative speculation counters summed over the ready engines (any method)."""
        import ray

        slots = [s for s in getattr(self.pool, "slots", []) if getattr(s, "state", "") == "ready"]
        out: dict[str, float] = {}
        if not slots:  # no engine to ask: no `ray.get`, which would start (or join) a Ray of its own
            return out
        for got in ray.get([s.actor.spec_counters.remote() for s in slots]):
            for k in ("tokens", "drafts", "verified_draft_tokens", "accepted_tokens", "engine_steps"):
                out[k] = out.get(k, 0.0) + float(got.get(k, 0.0))
        return out

    def _tokens_per_forward(self) -> dict[str, float]:
        if not self.cfg.enabled or not self._by_kind:
            return {}
        tok = sum(t for t, _ in self._by_kind.values())
        fwd = sum(f for _, f in self._by_kind.values())
        out = {"spec_tokens_per_forward": tok / fwd if fwd else 0.0}
        out.update({f"spec_tokens_per_forward_{k}": t / f for k, (t, f) in self._by_kind.items() if f})
        return out

    def summary(self) -> dict[str, Any]:
        """For summary.json: tokens per target forward of this run (this process), overall and per round kind,
        and with HistoSpec's cost gate its per-engine state (`spec_cost_gate`, see `gate_states`)."""
        out: dict[str, Any] = dict(self._tokens_per_forward())
        if out and self.active and self.cfg.cost_gate and (states := self.gate_states()):
            out["spec_cost_gate"] = states
        return out

    def gate_states(self) -> list[dict[str, Any]]:
        """Per engine, what its cost gate last based its decisions on: per bucket of running requests (keyed by
        the bucket's smallest count), the median ms per generated token of recent plain and drafted steps and how
        many of each it holds (`speculative/cost_gate.py`). docs/speculative.md explains how to read it."""
        try:
            engines = self._engine_stats()
        except Exception as e:  # an engine lost at the very end must not cost the run its summary
            log.warning("spec_cost_gate left out of the summary: the engines did not answer (%s)", e)
            return []
        return [stats["cost_gate"] for stats in engines if "cost_gate" in stats]

    def describe(self) -> str:
        """One line for the end of a run ("" without speculation)."""
        sm = self._tokens_per_forward()
        if not sm:
            return ""
        kinds = ", ".join(f"{k} rounds {sm[f'spec_tokens_per_forward_{k}']:.2f}" for k in ("short", "long")
                          if f"spec_tokens_per_forward_{k}" in sm)
        return (f"speculative decoding ({self.cfg.method}): {sm['spec_tokens_per_forward']:.2f} tokens per target "
                f"forward ({kinds})")

    def end_step(self, batch: Iterable[Any], kind: str = "") -> dict[str, float]:
        """Records the batch, ships it, and returns the step's `spec/*` metrics."""
        self.record_batch(batch)
        # Also without speculation: the step's tokens and forwards (1 token each) are the baseline's figures.
        out: dict[str, float] = {"spec/round_long": float(kind == "long")}
        vnow = self.vllm_counters()
        vstep = {k: v - self._before.get("vllm_" + k, 0.0) for k, v in vnow.items()}
        if vstep and min(vstep.values()) < 0:  # an engine restarted: its counters began again
            vstep = dict(vnow)
        if vstep.get("tokens"):
            vstep["forwards"] = vstep["tokens"] - vstep["accepted_tokens"]
            fig = summarize(vstep)
            out.update({k.replace("spec/", "spec/step/"): v for k, v in fig.items()})
            out["spec/step/engine_steps"] = vstep.get("engine_steps", 0.0)
            out["spec/step/drafts"] = vstep.get("drafts", 0.0)
            sums = self._by_kind.setdefault("long" if kind == "long" else "short", [0.0, 0.0])
            sums[0] += vstep["tokens"]
            sums[1] += vstep["forwards"]
        self._before.update({"vllm_" + k: v for k, v in vnow.items()})
        if not self.active:
            return out
        self.ship()
        now = self.counters()
        out["spec/history_prompts"] = float(len(self.store))
        out["spec/history_ship_s"] = self.ship_s
        out["spec/history_shipments"] = float(self.shipments)
        self.ship_s, self.shipments = 0.0, 0
        if now.get("steps"):
            out.update(summarize(now))  # since the start of the run, HistoSpec's own counting
            step = {k: now.get(k, 0.0) - self._before.get(k, 0.0) for k in now}
            if step.get("steps", 0) > 0:
                out["spec/step/drafter_s"] = step.get("drafter_s", 0.0)
                out["spec/step/drafter_ms_per_step"] = 1e3 * step.get("drafter_s", 0.0) / step["steps"]
                out["spec/step/gated_steps"] = step.get("gated_steps", 0.0)  # steps the cost gate kept plain
                for src in ("history", "own", "cross"):
                    if step.get(f"verified_{src}"):
                        out[f"spec/step/accepted_{src}"] = step.get(f"accepted_{src}", 0.0)
                        out[f"spec/step/verified_{src}"] = step[f"verified_{src}"]
            self._before.update(now)
        return out
