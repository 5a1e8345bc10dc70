"""`Sample`: the one record that flows from rollout through reward and scheduler to the trainer.

Also `Prompt`, the dataset-side record a sample is generated from. Times are seconds on the run's clock
(`time.monotonic()` of the driver, or the simulator's virtual clock); token counts are tokens of the
policy's tokenizer. Nothing here imports torch or an engine, so the scheduler and simulator use it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Unsigned element types for expert ids, narrowest first: (numpy dtype name, bytes, largest expert count held)
ROUTE_DTYPES = (("uint8", 1, 256), ("uint16", 2, 65536), ("uint32", 4, 2**32))


def route_dtype(num_experts: int) -> str:
    """The smallest unsigned integer dtype (numpy name) that holds expert ids 0..num_experts-1."""
    for name, _, most in ROUTE_DTYPES:
        if num_experts <= most:
            return name
    raise ValueError(f"{num_experts} experts do not fit in 32 bits")


def route_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """Bytes one token's routes take in a `RoutedExperts`: layers x top-k x the id's width (the bound per token)."""
    return num_layers * topk * dict((n, b) for n, b, _ in ROUTE_DTYPES)[route_dtype(num_experts)]


@dataclass
class RoutedExperts:
    """The experts an engine routed each token position to: [positions, MoE layers, top-k] expert ids, row-major,
    in `route_dtype(num_experts)` (uint8 up to 256 experts), kept as raw bytes so a `Sample` stays free of numpy
    and torch and checkpoints as plain data. Row i is input position i of the sample's sequence (prompt, then
    response): the routing of token i when it was fed to the model, which the log-prob of token i + 1 depends on.
    A finished sample of P prompt and R response tokens holds P + R - 1 rows (the last token is never fed)."""

    num_layers: int  # MoE layers (route columns)
    topk: int  # experts per token
    num_experts: int  # routed experts per layer (fixes the dtype)
    data: bytes = b""  # row-major [rows, num_layers, topk] ids, little-endian

    @property
    def dtype(self) -> str:
        return route_dtype(self.num_experts)

    @property
    def row_bytes(self) -> int:
        return route_bytes_per_token(self.num_layers, self.topk, self.num_experts)

    @property
    def num_rows(self) -> int:
        return len(self.data) // self.row_bytes

    @classmethod
    def from_array(cls, array, num_experts: int) -> RoutedExperts:
        """From an integer array-like of shape [rows, layers, topk] (numpy, torch or nested lists)."""
        import numpy as np

        a = np.asarray(array)
        if a.ndim != 3:
            raise ValueError(f"routed experts of shape {a.shape}; expected [positions, layers, topk]")
        if a.size and (a.min() < 0 or a.max() >= num_experts):
            raise ValueError(f"routed expert ids outside [0, {num_experts})")
        return cls(a.shape[1], a.shape[2], num_experts, a.astype(np.dtype(route_dtype(num_experts)).newbyteorder("<"),
                                                                copy=False).tobytes())

    def array(self):
        """The ids as a numpy array [rows, layers, topk] (read-only view of `data`)."""
        import numpy as np

        dt = np.dtype(self.dtype).newbyteorder("<")
        return np.frombuffer(self.data, dtype=dt).reshape(self.num_rows, self.num_layers, self.topk)

    def extended(self, other: RoutedExperts, start: int = 0) -> RoutedExperts:
        """These rows, then `other`'s rows for positions past them (`other`'s first row is position `start`).
        Positions both hold keep this record's routes: the routing under which their log-probs were taken."""
        if (other.num_layers, other.topk, other.num_experts) != (self.num_layers, self.topk, self.num_experts):
            raise ValueError("routed experts of a different shape cannot extend these")
        have = self.num_rows
        if start > have:
            raise ValueError(f"routed experts from position {start} leave a gap after position {have}")
        skip = (have - start) * self.row_bytes
        return RoutedExperts(self.num_layers, self.topk, self.num_experts, self.data + other.data[skip:])


# `Sample.meta` keys a trajectory keeps while it runs (agentic/trajectory.py); an on-policy restart drops them
TRAJECTORY_META = ("tool_state", "awaiting_tools", "tool_calls", "tool_errors", "tool_seconds", "tool_error_kinds",
                   "trajectory", "trajectory_end")


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
    # MoE models with rollout routing replay: the experts the engine routed every input position to (prompt and
    # response, see `RoutedExperts`); None for dense models, with capture off, or while nothing was returned
    # (vLLM returns routes when a request finishes, so an aborted partial holds none until it is resumed and
    # finishes: the resumed request re-routes the carried tokens under its own version).
    routed_experts: RoutedExperts | None = None
    # trajectories (multi-turn tool use, megatron_sortedrl/agentic/trajectory.py): [start, end) response-token
    # ranges the chat template rendered from tool messages (not sampled: placeholder log-prob 0.0, masked from the
    # loss), ascending; and the assistant turns generated so far. Empty / 0 for a one-response sample.
    tool_spans: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0

    @property
    def sample_id(self) -> str:
        """Unique within a run: prompt id, epoch and response index."""
        return f"{self.prompt_id}/e{self.epoch}/{self.index}"

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def generated_length(self) -> int:
        """Response tokens the engine sampled (a trajectory's tool tokens left out)."""
        return len(self.response_tokens) - sum(end - start for start, end in self.tool_spans)

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

    def add_routes(self, routes: RoutedExperts, start: int = 0) -> None:
        """Takes an engine's routes whose first row is input position `start` (0: the prompt's first token);
        positions already held keep their routes."""
        if self.routed_experts is None:
            if start:
                raise ValueError(f"{self.sample_id}: routes from position {start} but none before it")
            self.routed_experts = routes
        else:
            self.routed_experts = self.routed_experts.extended(routes, start)
        most = len(self.prompt_tokens) + len(self.response_tokens) - 1
        if self.routed_experts.num_rows > most:
            raise ValueError(f"{self.sample_id}: {self.routed_experts.num_rows} route rows for {most} input positions")

    def loss_mask(self) -> list[float] | None:
        """Per response token, 1.0 where the loss applies and 0.0 on tool tokens; None when every token counts
        (a sample without tool spans). Overlong masking (`meta["loss_masked"]`) is the trainer's, on top."""
        if not self.tool_spans:
            return None
        mask = [1.0] * len(self.response_tokens)
        for start, end in self.tool_spans:
            mask[start:end] = [0.0] * (end - start)
        return mask

    def reset_response(self) -> None:
        """Drops generated tokens (on-policy abort): the sample will be generated again from scratch (a
        trajectory from its first turn, with a fresh tool state)."""
        self.response_tokens, self.rollout_logprobs, self.version_spans = [], [], []
        self.routed_experts = None
        self.finish_reason = ""
        self.tool_spans, self.turns = [], 0
        for key in TRAJECTORY_META:
            self.meta.pop(key, None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what checkpoints and the scheduler state hold; routes stay bytes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["version_spans"] = [tuple(s) for s in d.get("version_spans", [])]
        d["tool_spans"] = [tuple(s) for s in d.get("tool_spans", [])]
        if d.get("routed_experts") is not None:
            d["routed_experts"] = RoutedExperts(**d["routed_experts"])
        return cls(**d)
