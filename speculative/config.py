"""Configuration of speculative decoding during rollout (`speculative.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError

METHODS = ("histospec", "ngram", "suffix")
SOURCES = ("history", "own", "cross")  # speculative.drafter.SOURCES (not imported: config stays light)


@dataclass
class SpeculativeConfig:
    enabled: bool = field(default=True, metadata={"help": "Use speculative decoding in rollout; off means vanilla vLLM."})
    method: str = field(
        default="histospec",
        metadata={"help": "histospec (previous responses to the same prompt) | ngram | suffix (vLLM built-ins).", "choices": METHODS},
    )
    min_draft_tokens: int = field(
        default=2, metadata={"help": "Adaptive draft length floor and start value (with adaptive_draft_length).", "min": 1}
    )
    max_draft_tokens: int = field(default=16, metadata={"help": "Longest draft; also vLLM's num_speculative_tokens.", "min": 1})
    adaptive_draft_length: bool = field(
        default=False,
        metadata={"help": "Per-request draft length (start at min_draft_tokens, x2 after a full accept, /2 after a "
                          "miss); off: every draft may reach max_draft_tokens and min_confidence alone ends it."},
    )
    match_tokens: int = field(default=7, metadata={"help": "Tail length of the current response matched against history.", "min": 1})
    min_confidence: float = field(
        default=0.1, metadata={"help": "Drop draft tokens whose history frequency falls below this fraction.", "min": 0, "max": 1}
    )
    history_max_prompts: int = field(
        default=100_000, metadata={"help": "Prompts kept in the draft history store (least recently updated evicted).", "min": 1}
    )
    history_max_responses: int = field(
        default=16, metadata={"help": "Responses kept per prompt (newest epochs first; an older epoch's give way).", "min": 1}
    )
    history_epochs: int = field(
        default=2, metadata={"help": "Epochs of responses kept per prompt as drafts (1: the latest epoch only).", "min": 1}
    )
    history_epoch_weight: float = field(
        default=2.0, metadata={"help": "A response of a newer epoch counts this many times one of the epoch before.", "min": 1.0}
    )
    sources: list[str] = field(
        default_factory=lambda: list(SOURCES),
        metadata={"help": "HistoSpec draft sources: history (previous and sibling responses to the same prompt), "
                          "own (the request's own text), cross (other requests' responses on the engine).", "choices": SOURCES},
    )
    sibling_drafts: bool = field(
        default=True,
        metadata={"help": "Record each response as it finishes and ship it to the engines during the round, so "
                          "its still-running siblings draft from it."},
    )
    sibling_ship_interval_s: float = field(
        default=0.2, metadata={"help": "Least time between two history shipments during a round (seconds).", "min": 0}
    )
    max_batch_rows: int = field(
        default=0, metadata={"help": "No drafts in an engine step with more running requests than this (0: no limit).", "min": 0}
    )
    step_draft_budget: int = field(
        default=0, metadata={"help": "Draft tokens per engine step, shared by its running requests (0: no limit).", "min": 0}
    )
    cost_gate: bool = field(
        default=True,
        metadata={"help": "HistoSpec: per engine step, draft only where the engine's measured time per generated "
                          "token, for that many running requests, is lower with drafts than without "
                          "(speculative/cost_gate.py): on in the tail, off in a full batch whose drafts do not "
                          "pay. Always on with one running request."},
    )

    min_history_share: float = field(
        default=0.5,
        metadata={"help": "HistoSpec: a round runs on speculative engines only when at least this share of its "
                          "prompts has responses of an earlier epoch; other rounds (epoch 0) run on plain engines, "
                          "which keep vLLM's fast path (speculative/fast_path.py). 0: speculative engines always.",
                  "min": 0, "max": 1},
    )

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("speculative.method", self.method, "one of " + ", ".join(METHODS))
        if self.min_draft_tokens < 1:
            raise ConfigError("speculative.min_draft_tokens", self.min_draft_tokens, "an integer >= 1")
        if self.max_draft_tokens < self.min_draft_tokens:
            raise ConfigError(
                "speculative.max_draft_tokens", self.max_draft_tokens, f"an integer >= min_draft_tokens ({self.min_draft_tokens})"
            )
        if self.match_tokens < 1:
            raise ConfigError("speculative.match_tokens", self.match_tokens, "an integer >= 1")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ConfigError("speculative.min_confidence", self.min_confidence, "a float in [0, 1]")
        if self.history_max_prompts < 1:
            raise ConfigError("speculative.history_max_prompts", self.history_max_prompts, "an integer >= 1")
        if self.history_max_responses < 1:
            raise ConfigError("speculative.history_max_responses", self.history_max_responses, "an integer >= 1")
        if self.history_epochs < 1:
            raise ConfigError("speculative.history_epochs", self.history_epochs, "an integer >= 1")
        if self.history_epoch_weight < 1.0:
            raise ConfigError("speculative.history_epoch_weight", self.history_epoch_weight, "a float >= 1")
        if not self.sources or any(x not in SOURCES for x in self.sources):
            raise ConfigError("speculative.sources", self.sources, "a non-empty list of " + ", ".join(SOURCES))
        if self.sibling_ship_interval_s < 0:
            raise ConfigError("speculative.sibling_ship_interval_s", self.sibling_ship_interval_s, "a float >= 0")
        if self.max_batch_rows < 0:
            raise ConfigError("speculative.max_batch_rows", self.max_batch_rows, "an integer >= 0 (0: no limit)")
        if not 0.0 <= self.min_history_share <= 1.0:
            raise ConfigError("speculative.min_history_share", self.min_history_share, "a float in [0, 1]")
        if self.step_draft_budget < 0:
            raise ConfigError("speculative.step_draft_budget", self.step_draft_budget, "an integer >= 0 (0: no limit)")
