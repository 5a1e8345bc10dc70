"""Speculation metrics: tokens per target forward, acceptance rate, mean accepted length, drafter time.

    stats = SpecStats()                        # the proposer fills it inside the vLLM worker
    stats.on_step(...); stats.on_request_end(...)
    summary = stats.summary()                  # {"spec/tokens_per_forward": ..., ...}
    write_records(run_dir / "speculation.jsonl", stats.drain(), clock_t=...)

Definitions (DESIGN section 4), counted per request and summed:
- a *target forward* of a request is one engine step in which the request was verified/decoded; each
  forward emits `1 + accepted` tokens, so `forwards = tokens - accepted`;
- *tokens per forward* = emitted tokens / forwards (1.0 without speculation);
- *acceptance rate* = accepted draft tokens / verified draft tokens;
- *mean accepted length* = accepted draft tokens / verified drafts (drafts of length >= 1);
- *drafter time* = wall time spent inside the proposer (per step, and the share spent on each request).
A draft proposed on a request's last step is never verified and is not counted.

`from_vllm_metrics` turns the engine's own counters (`LLM.get_metrics()`, prometheus names
`vllm:spec_decode_*`, `vllm:generation_tokens`) into the same figures, which is how the benchmark measures
vLLM's built-in `ngram` and `suffix` methods and cross-checks HistoSpec.

Per-step and per-request records go to a JSON-lines file of their own (`speculation.jsonl`, fields as in
`StepRecord` / `RequestRecord`), on the run clock, next to the run's `timeline*.jsonl`.
Left out: a draft length histogram beyond what the per-step records allow to recompute.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterable


@dataclass
class StepRecord:
    step: int  # proposer call number in this worker (one per engine step with decodes)
    rows: int  # requests that produced tokens this step
    tokens: int  # tokens emitted this step (over all rows)
    verified_draft_tokens: int  # draft tokens from the previous step verified in this step
    accepted_tokens: int  # of those, accepted
    drafted_rows: int  # rows that got a draft for the next step
    draft_tokens: int  # tokens proposed for the next step
    drafter_s: float  # seconds inside propose()
    kind: str = "spec_step"


@dataclass
class RequestRecord:
    request: str  # vLLM request id when the proposer can see it, else "row<i>@<first step>"
    prompt_key: str  # history key of its prompt ("" without history)
    forwards: int  # target forwards (engine steps that emitted tokens for it)
    tokens: int  # tokens emitted
    verified_draft_tokens: int
    accepted_tokens: int
    drafts: int  # verified drafts (length >= 1)
    drafter_s: float  # time spent drafting for it
    kind: str = "spec_request"

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0


class SpecStats:
    """Accumulates totals plus bounded queues of step and request records."""

    def __init__(self, max_records: int = 200_000) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=max_records)
        self.requests: deque[RequestRecord] = deque(maxlen=max_records)
        self.totals = {"steps": 0, "forwards": 0, "tokens": 0, "verified_draft_tokens": 0,
                       "accepted_tokens": 0, "drafts": 0, "draft_tokens": 0, "drafter_s": 0.0}

    def on_step(self, rec: StepRecord, forwards: int, drafts_verified: int) -> None:
        self.steps.append(rec)
        t = self.totals
        t["steps"] += 1
        t["forwards"] += forwards
        t["tokens"] += rec.tokens
        t["verified_draft_tokens"] += rec.verified_draft_tokens
        t["accepted_tokens"] += rec.accepted_tokens
        t["drafts"] += drafts_verified
        t["draft_tokens"] += rec.draft_tokens
        t["drafter_s"] += rec.drafter_s

    def on_request_end(self, rec: RequestRecord) -> None:
        self.requests.append(rec)

    def summary(self) -> dict[str, float]:
        return summarize(self.totals)

    def drain(self) -> list[dict[str, Any]]:
        """All records since the last drain, as plain dicts (steps first, then finished requests)."""
        out = [asdict(r) for r in self.steps] + [dict(asdict(r), tokens_per_forward=r.tokens_per_forward)
                                                 for r in self.requests]
        self.steps.clear()
        self.requests.clear()
        return out

    def reset(self) -> None:
        self.__init__(self.steps.maxlen or 200_000)  # type: ignore[misc]


def summarize(t: dict[str, float]) -> dict[str, float]:
    """Figures from raw counters (`tokens`, `forwards`, `verified_draft_tokens`, `accepted_tokens`,
    `drafts`, `drafter_s`, `steps`), named as they appear in the run's metrics."""
    forwards = t.get("forwards") or (t["tokens"] - t["accepted_tokens"])
    out = {
        "spec/tokens": float(t["tokens"]),
        "spec/target_forwards": float(forwards),
        "spec/tokens_per_forward": t["tokens"] / forwards if forwards else 0.0,
        "spec/acceptance_rate": (t["accepted_tokens"] / t["verified_draft_tokens"]
                                 if t["verified_draft_tokens"] else 0.0),
        "spec/mean_accepted_length": t["accepted_tokens"] / t["drafts"] if t.get("drafts") else 0.0,
        "spec/draft_tokens": float(t["verified_draft_tokens"]),
        "spec/accepted_tokens": float(t["accepted_tokens"]),
    }
    if "drafter_s" in t:
        out["spec/drafter_s"] = float(t["drafter_s"])
        out["spec/drafter_ms_per_step"] = 1e3 * t["drafter_s"] / t["steps"] if t.get("steps") else 0.0
    return out


def merge_totals(many: Iterable[dict[str, float]]) -> dict[str, float]:
    """Sums the totals of several workers (TP ranks report the same numbers: pass rank 0's only)."""
    out: dict[str, float] = {}
    for t in many:
        for k, v in t.items():
            out[k] = out.get(k, 0) + v
    return out


def from_vllm_metrics(metrics: Iterable[Any], before: dict[str, float] | None = None) -> dict[str, float]:
    """Counters from `LLM.get_metrics()`; pass an earlier result as `before` to get the difference.

    Returns raw counters (`tokens`, `drafts`, `verified_draft_tokens`, `accepted_tokens`, `engine_steps`) plus the
    `summarize` figures, so several engines' counters can be compared like for like."""
    names = {"vllm:generation_tokens": "tokens", "vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "verified_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    raw = {v: 0.0 for v in names.values()}
    raw["engine_steps"] = 0.0  # batched forward passes (all requests together)
    for m in metrics:
        name = getattr(m, "name", "")
        if name in names and hasattr(m, "value"):
            raw[names[name]] += float(m.value)
        elif name == "vllm:iteration_tokens_total" and hasattr(m, "count"):
            raw["engine_steps"] += float(m.count)
    if before:
        raw = {k: raw[k] - before.get(k, 0.0) for k in raw}
    raw["forwards"] = raw["tokens"] - raw["accepted_tokens"]
    return {**raw, **summarize(raw)}


def write_records(path: str | os.PathLike, records: Iterable[dict[str, Any]], t: float | None = None,
                  worker: int | None = None, train_step: int | None = None) -> int:
    """Appends records as JSON lines, stamped with the run-clock time `t`, worker and training step."""
    n = 0
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            extra = {k: v for k, v in (("t", t), ("worker", worker), ("train_step", train_step)) if v is not None}
            f.write(json.dumps({**extra, **rec}, separators=(",", ":")) + "\n")
            n += 1
    return n
