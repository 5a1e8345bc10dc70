"""Configuration of speculative decoding during rollout (`speculative.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sortedrl.errors import ConfigError

METHODS = ("histospec", "ngram", "suffix")


@dataclass
class SpeculativeConfig:
    enabled: bool = field(default=True, metadata={"help": "Use speculative decoding in rollout; off means vanilla vLLM."})
    method: str = field(
        default="histospec",
        metadata={"help": "histospec (previous responses to the same prompt) | ngram | suffix (vLLM built-ins)."},
    )
    min_draft_tokens: int = field(default=2, metadata={"help": "Adaptive draft length floor (and start value)."})
    max_draft_tokens: int = field(default=16, metadata={"help": "Adaptive draft length cap; also vLLM's num_speculative_tokens."})
    match_tokens: int = field(default=7, metadata={"help": "Tail length of the current response matched against history."})
    min_confidence: float = field(
        default=0.1, metadata={"help": "Drop draft tokens whose history frequency falls below this fraction."}
    )
    history_max_prompts: int = field(
        default=100_000, metadata={"help": "Prompts kept in the draft history store (least recently updated evicted)."}
    )
    history_max_responses: int = field(
        default=16, metadata={"help": "Responses kept per prompt (the latest epoch's first ones)."}
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
