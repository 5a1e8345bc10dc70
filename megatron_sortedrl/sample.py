"""`Sample`: the one record that flows from rollout through reward and scheduler to the trainer.

Also `Prompt`, the dataset-side record a sample is generated from. Times are seconds on the run's clock
(`time.monotonic()` of the driver, or the simulator's virtual clock); token counts are tokens of the
policy's tokenizer. Nothing here imports torch or an engine, so the scheduler and simulator use it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Prompt:
    prompt_id: str  # stable id across epochs (dataset name + row, or the generator's id); history keys on it
    text: str  # the prompt as given to the tokenizer (after any chat template)
    ground_truth: str  # what the reward function compares against
    source: str = ""  # task or file the prompt came from, for metrics per source
    difficulty: int = 0  # generator's difficulty knob (digits, K&K people); 0 for files
    solution: str = ""  # a worked solution when the task has one (supervised warm start, length statistics)
    meta: dict[str, Any] = field(default_factory=dict)  # anything else from the dataset row


@dataclass
class Sample:
    # identity
    prompt_id: str  # `Prompt.prompt_id`
    index: int  # which of the n responses to this prompt in this epoch, 0..n-1
    epoch: int = 0  # pass over the dataset this sample belongs to
    # tokens
    prompt_tokens: list[int] = field(default_factory=list)  # token ids of the prompt
    response_tokens: list[int] = field(default_factory=list)  # token ids generated so far (partial until finished)
    rollout_logprobs: list[float] = field(default_factory=list)  # per response token: log p under the behaviour policy (nats)
    # policy version spans: (first response-token index, version) pairs, ascending. Token i was sampled by
    # the version of the last span starting at or before i. One span unless a partial rollout was resumed.
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    response_text: str = ""  # decoded response, filled by the driver before scoring (what reward functions read)
    finish_reason: str = ""  # "stop" (EOS / stop string), "length" (max tokens), "abort", or "" while running
    # reward
    ground_truth: str = ""  # copied from the prompt so reward workers need nothing else
    reward: float | None = None  # scalar reward; None until scored
    reward_error: str = ""  # the exception text when the reward function raised or timed out (reward is then 0)
    # timing and placement (seconds on the run clock)
    submit_time: float = 0.0  # first submission of this sample to an engine
    first_token_time: float = 0.0  # first response token received
    finish_time: float = 0.0  # finished (or aborted for the last time)
    worker_id: int = -1  # rollout worker that produced the last token
    num_resumes: int = 0  # times a partial rollout of this sample was continued after an abort
    predicted_length: float = 0.0  # scheduler's length prediction in tokens when it was submitted (0: none)
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific extras (difficulty, source)

    @property
    def sample_id(self) -> str:
        """Unique within a run: prompt id, epoch and response index."""
        return f"{self.prompt_id}/e{self.epoch}/{self.index}"

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def oldest_version(self) -> int:
        """Policy version that sampled the earliest response token (-1 when nothing was sampled)."""
        return self.version_spans[0][1] if self.version_spans else -1

    def token_versions(self) -> list[int]:
        """Per response token, the policy version that sampled it (expands `version_spans`)."""
        out: list[int] = []
        spans = self.version_spans + [(len(self.response_tokens), -1)]
        for (start, version), (end, _) in zip(spans, spans[1:]):
            out.extend([version] * (end - start))
        return out

    def append(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        """Adds newly sampled tokens from policy `version`, opening a new span when the version changed."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"{self.sample_id}: {len(tokens)} tokens but {len(logprobs)} log-probs")
        if tokens and (not self.version_spans or self.version_spans[-1][1] != version):
            self.version_spans.append((len(self.response_tokens), version))
        self.response_tokens.extend(tokens)
        self.rollout_logprobs.extend(logprobs)

    def reset_response(self) -> None:
        """Drops generated tokens (on-policy abort): the sample will be generated again from scratch."""
        self.response_tokens, self.rollout_logprobs, self.version_spans = [], [], []
        self.finish_reason = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["version_spans"] = [tuple(s) for s in d.get("version_spans", [])]
        return cls(**d)
