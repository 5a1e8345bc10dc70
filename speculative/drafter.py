"""HistoSpec drafter: continuation drafts from the previous responses to the same prompt (pure logic).

    drafter = HistoryDrafter(DraftSettings(match_tokens=7, max_draft_tokens=16, min_confidence=0.1))
    drafter.set_prompt(prompt_tokens, previous_responses)
    draft = drafter.draft(key, tokens_so_far, max_tokens=length.value)   # prompt + response so far
    length = AdaptiveDraftLength(2, 16); length.update(proposed=len(draft.token_ids), accepted=a)

Sources, each a chain that vLLM's rejection sampler verifies (so each is lossless on its own):
- `history`: the previous responses to the same prompt (this module's per-prompt trees), over the last
  `keep_epochs` epochs with each newer epoch counted `epoch_weight` times the one before, and including
  the *siblings* of the current round (the driver records every finished response at once and ships it,
  so the n samples of a prompt that finished early draft for those still running: the long tail);
- `own`: the request's own prompt and response so far (self-repetition, what vLLM's `ngram` covers);
- `cross`: the responses of every request this engine has run or is running, across prompts (what vLLM's
  `suffix` method keeps in its global tree), including siblings still running on the same engine.
`FallbackDrafter` keeps the `own` and `cross` trees; the proposer takes the highest-scoring draft (score =
expected accepted tokens, the sum of the path frequencies) of the enabled sources.

Index: one suffix tree per prompt (`arctic_inference`'s native `SuffixTree`, the structure behind vLLM's
`suffix` method) holding that prompt's history responses, each prefixed by the last `match_tokens`
tokens of the prompt so that the very first response tokens can be matched too. A lookup walks the
last `match_tokens` tokens of the current sequence into the tree (the longest matching suffix wins on
score) and follows the most frequent branch; the product of branch frequencies along the path is the
draft's confidence, and the draft stops where it falls below `min_confidence`. A lookup costs about a
microsecond natively plus Python call overhead, far below a decode step of any model worth speeding up.

Trajectories (turns aligned): a history response may be a trajectory stored as its generated turns (tool
tokens cut out, `speculative.history`). The prompt's index then holds one tree per turn index k (the turn k of
every stored trajectory, each prefixed by the prompt's tail as above) and one tree of all turns. A request
generating turn k (a continued request: prompt, turns 1..k-1 and tool messages) is matched with the prompt's
tail followed by its current turn so far, in the turn-k tree: at a turn's start the draft is the previous
epoch's turn k from its start, never another turn's text or a tool message. Only when the turn-k tree has no
match at all (or the prompt never reached turn k) does the all-turns tree draft. The proposer finds k and the
turn's start in a row by `turn_marker` (the tokens that end every rendered tool message: the chat template's
assistant header), counted after the prompt (`HistoryDrafter.turn_of`).

Why per-prompt trees rather than one global tree (vLLM's `suffix`): RL rollouts revisit the same prompt
each epoch, and its previous responses are far better predictors than other prompts' responses; a
per-prompt tree also cannot be polluted by unrelated text and evicts with its prompt.

`AdaptiveDraftLength` is the per-request rule of DESIGN section 3: start at the floor, double (up to
the cap) after a draft that was accepted in full, halve (down to the floor) otherwise.

Deliberately left out: draft trees inside vLLM (its custom proposer takes chains only;
`draft(..., tree=True)` returns the tree for engines that can verify one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from speculative.history import HistoryEntry, prompt_key

SOURCES = ("history", "own", "cross")
MAX_REPLICAS = 8  # epoch weighting inserts a response this many times at most

@dataclass(frozen=True)
class DraftSettings:
    match_tokens: int = 7  # tail of the current sequence matched against history
    min_draft_tokens: int = 2  # adaptive length floor and start value
    max_draft_tokens: int = 16  # longest draft (the adaptive length's cap)
    adaptive_length: bool = False  # per-request length rule; off: up to max_draft_tokens, confidence decides
    min_confidence: float = 0.1  # stop drafting where the history path frequency falls below this
    max_spec_factor: float = 4.0  # a match of m tokens may draft at most m * factor tokens
    epoch_weight: float = 2.0  # a response of a newer epoch counts this many times one of the epoch before
    sources: tuple[str, ...] = ("history", "own", "cross")  # draft sources tried (see SOURCES)
    cross_requests: int = 1024  # responses kept in the cross-prompt tree (oldest dropped first)
    max_batch_rows: int = 0  # no drafts in a step with more running rows than this (0: no limit)
    step_draft_budget: int = 0  # draft tokens per engine step, shared by its rows (0: no limit)
    cost_gate: bool = True  # no drafts in a step whose measured cost says they do not pay (speculative.cost_gate)
    turn_marker: tuple[int, ...] = ()  # tokens ending every tool message (the next turn's header); (): one turn

    def __post_init__(self) -> None:
        if not 1 <= self.min_draft_tokens <= self.max_draft_tokens:
            raise ValueError("need 1 <= min_draft_tokens <= max_draft_tokens")
        if self.match_tokens < 1 or not 0.0 <= self.min_confidence <= 1.0 or self.max_spec_factor <= 0:
            raise ValueError("need match_tokens >= 1, 0 <= min_confidence <= 1, max_spec_factor > 0")
        if self.epoch_weight < 1.0 or self.cross_requests < 1 or self.max_batch_rows < 0 or self.step_draft_budget < 0:
            raise ValueError("need epoch_weight >= 1, cross_requests >= 1, max_batch_rows >= 0, step_draft_budget >= 0")
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "turn_marker", tuple(int(t) for t in self.turn_marker))
        unknown = set(self.sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown draft sources {sorted(unknown)}; choose from {SOURCES}")

    @classmethod
    def from_config(cls, cfg) -> DraftSettings:
        """From `speculative.config.SpeculativeConfig` (or anything with the same attributes)."""
        return cls(match_tokens=cfg.match_tokens, min_draft_tokens=cfg.min_draft_tokens,
                   max_draft_tokens=cfg.max_draft_tokens, min_confidence=cfg.min_confidence,
                   adaptive_length=getattr(cfg, "adaptive_draft_length", False),
                   epoch_weight=getattr(cfg, "history_epoch_weight", 2.0),
                   sources=tuple(getattr(cfg, "sources", SOURCES)),
                   max_batch_rows=getattr(cfg, "max_batch_rows", 0),
                   step_draft_budget=getattr(cfg, "step_draft_budget", 0),
                   cost_gate=getattr(cfg, "cost_gate", True))


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)  # proposed continuation (chain, or tree nodes)
    probs: list[float] = field(default_factory=list)  # history path frequency of each token
    parents: list[int] = field(default_factory=list)  # tree: index of each token's parent, -1 for root
    match_len: int = 0  # how many trailing tokens matched the history
    score: float = 0.0  # expected accepted tokens (sum of the path frequencies)
    source: str = ""  # which source drafted it


class AdaptiveDraftLength:
    """Per-request draft length: start at `low`, x2 (cap `high`) if all accepted, /2 (floor `low`) else."""

    __slots__ = ("low", "high", "value")

    def __init__(self, low: int = 2, high: int = 16) -> None:
        self.low, self.high, self.value = low, high, low

    def update(self, proposed: int, accepted: int) -> int:
        if proposed > 0:  # no draft, no evidence: keep the length
            if accepted >= proposed:
                self.value = min(self.value * 2, self.high)
            else:
                self.value = max(self.value // 2, self.low)
        return self.value


class PromptIndex:
    """Suffix trees over one prompt's history: per turn index, and over all turns when a response has several
    (each sequence prefixed with the prompt's tail). A plain response is one turn: turn 0's tree is the old
    per-prompt tree."""

    def __init__(self, prompt_tokens: np.ndarray, responses: Sequence[np.ndarray], settings: DraftSettings,
                 epochs: Sequence[int] | None = None, turn_lens: Sequence[Sequence[int]] | None = None) -> None:
        from arctic_inference.suffix_decoding._C import SuffixTree

        self.prompt_len = len(prompt_tokens)
        self.num_responses = len(responses)
        # Depth bounds the matched context plus the draft; arctic matches strictly shorter than the context.
        depth = settings.match_tokens + settings.max_draft_tokens + 1
        tail = np.asarray(prompt_tokens[-settings.match_tokens:], dtype=np.int32)
        epochs = list(epochs) if epochs is not None and len(epochs) == len(responses) else [0] * len(responses)
        turn_lens = list(turn_lens) if turn_lens is not None and len(turn_lens) == len(responses) \
            else [[len(r)] for r in responses]
        newest = max(epochs, default=0)
        span = min(newest - min(epochs, default=0), 3)  # beyond 3 epochs apart the weights stop changing
        self.trees: dict[int, Any] = {}  # turn index -> tree of that turn of every trajectory
        multi = any(len(t) > 1 for t in turn_lens)
        self.any_turn = SuffixTree(depth) if multi else None  # every turn of every trajectory
        seq_id = 0
        for response, epoch, lens in zip(responses, epochs, turn_lens):
            # Older epochs weigh less: the tree counts paths, so a newer response is inserted more times.
            replicas = min(MAX_REPLICAS, max(1, round(settings.epoch_weight ** (span - (newest - epoch)))))
            bounds = np.cumsum([0, *lens])
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                if b <= a:
                    continue  # an empty turn: nothing to draft, its index stays aligned
                seq = np.ascontiguousarray(np.concatenate([tail, response[a:b]]), dtype=np.int32)
                trees = [self.trees.setdefault(k, SuffixTree(depth))] + ([self.any_turn] if multi else [])
                for tree in trees:
                    for _ in range(replicas):
                        tree.extend_ndarray(seq_id, seq)
                        seq_id += 1
        if not multi:
            self.any_turn = self.trees.get(0)  # one turn per response: turn 0 is every turn there is


class HistoryDrafter:
    """Per-prompt indexes plus the lookup from an engine's token row to its prompt."""

    def __init__(self, settings: DraftSettings | None = None) -> None:
        self.settings = settings or DraftSettings()
        self._index: dict[str, PromptIndex] = {}
        # Row -> prompt lookup without knowing the prompt length: candidate lengths per short prefix digest.
        self._prefix_lengths: dict[bytes, set[int]] = {}
        self._prefix_of: dict[str, bytes] = {}
        self.generation = 0  # bumps on every change, so callers can re-resolve rows that had no history

    PREFIX = 8  # tokens of the prompt start used to narrow the candidate lengths

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def set_prompt(self, prompt_tokens: Sequence[int] | np.ndarray, responses: Sequence[Sequence[int]],
                   key: str | None = None, epochs: Sequence[int] | None = None,
                   turn_lens: Sequence[Sequence[int]] | None = None) -> str:
        """The prompt's history: `responses` (of `epochs`), each split into generated turns by `turn_lens`
        (lengths adding up to the response; None: each response is one turn)."""
        prompt = np.ascontiguousarray(prompt_tokens, dtype=np.int32)
        key = key or prompt_key(prompt)
        n = len(responses)
        kept = [(np.ascontiguousarray(r, dtype=np.int32), e, t)
                for r, e, t in zip(responses, epochs if epochs is not None else [0] * n,
                                   turn_lens if turn_lens is not None else [[len(r)] for r in responses]) if len(r)]
        rs, epochs, lens = [r for r, _, _ in kept], [e for _, e, _ in kept], [t for _, _, t in kept]
        self.remove(key)
        if rs:
            self._index[key] = PromptIndex(prompt, rs, self.settings, epochs, lens)
            prefix = self._prefix(prompt)
            self._prefix_lengths.setdefault(prefix, set()).add(len(prompt))
            self._prefix_of[key] = prefix
        self.generation += 1
        return key

    def _prefix(self, prompt: np.ndarray) -> bytes:
        # Prompts shorter than PREFIX share one bucket (b"") that every lookup also checks.
        return prompt[:self.PREFIX].tobytes() if len(prompt) >= self.PREFIX else b""

    def set_entries(self, entries: dict[str, HistoryEntry]) -> None:
        for key, entry in entries.items():
            self.set_prompt(entry.prompt_tokens, entry.responses, key=key, epochs=entry.epochs(),
                            turn_lens=entry.turn_lengths())

    def remove(self, key: str) -> None:
        index = self._index.pop(key, None)
        if index is None:
            return
        prefix = self._prefix_of.pop(key)
        # Keep the length candidate unless no other prompt with this prefix has it (cheap to over-keep).
        if not any(self._prefix_of.get(k) == prefix and i.prompt_len == index.prompt_len
                   for k, i in self._index.items()):
            self._prefix_lengths.get(prefix, set()).discard(index.prompt_len)
        self.generation += 1

    def clear(self) -> None:
        self._index.clear()
        self._prefix_lengths.clear()
        self._prefix_of.clear()
        self.generation += 1

    def resolve(self, row: np.ndarray, num_tokens: int) -> tuple[str, int] | None:
        """Finds the prompt with history that `row[:num_tokens]` starts with: (key, prompt_len) or None.

        Tries the longest candidate first so a prompt that extends another known prompt wins."""
        lengths = self._prefix_lengths.get(np.ascontiguousarray(row[:self.PREFIX], dtype=np.int32).tobytes(), set())
        lengths = lengths | self._prefix_lengths.get(b"", set())  # prompts shorter than PREFIX
        if not lengths:
            return None
        for length in sorted(lengths, reverse=True):
            if length < num_tokens:
                key = prompt_key(row[:length])
                if key in self._index:
                    return key, length
        return None

    def turn_of(self, row: np.ndarray, prompt_len: int, num_tokens: int) -> tuple[int, int]:
        """(turn index, row index where that turn starts) of a row whose first `prompt_len` tokens are its
        prompt: every `turn_marker` after the prompt ends a tool message and opens the next turn."""
        marker = np.asarray(self.settings.turn_marker, dtype=np.int32)
        m = len(marker)
        seg = np.asarray(row[prompt_len:num_tokens], dtype=np.int32)
        if not m or len(seg) < m:
            return 0, prompt_len
        hits = np.flatnonzero(seg[:len(seg) - m + 1] == marker[0])
        ends = [int(i) + m for i in hits if np.array_equal(seg[i:i + m], marker)]
        turn, last = 0, -1
        for end in ends:  # occurrences never overlap (a marker inside a marker is not a new turn)
            if end - m >= last:
                turn, last = turn + 1, end
        return turn, prompt_len + (last if turn else 0)

    def draft(self, key: str, tokens: np.ndarray, max_tokens: int, tree: bool = False, turn: int = 0,
              turn_start: int | None = None) -> Draft:
        """Draft continuing `tokens` (prompt + response so far, int32) from the prompt's history. For turn k of
        a trajectory (`turn`, starting at row index `turn_start`), the prompt's tail and this turn so far are
        matched against the previous trajectories' turn k (module docstring)."""
        index = self._index.get(key)
        if index is None or max_tokens <= 0 or len(tokens) == 0:
            return Draft()
        s = self.settings
        width = s.match_tokens + 1
        start = index.prompt_len if turn_start is None else turn_start
        if start > index.prompt_len and len(tokens) - start < width:  # the turn is short: lead with the prompt
            context = np.concatenate([tokens[max(0, index.prompt_len - width):index.prompt_len], tokens[start:]])
        else:
            context = tokens
        context = np.ascontiguousarray(context[-width:], dtype=np.int32)
        primary = index.trees.get(turn)
        found = None
        if primary is not None:
            found = primary.speculate_ndarray(context, int(max_tokens), s.max_spec_factor, 0.0, s.min_confidence, tree)
        if (found is None or found.match_len == 0) and index.any_turn is not None and index.any_turn is not primary:
            found = index.any_turn.speculate_ndarray(context, int(max_tokens), s.max_spec_factor, 0.0,
                                                     s.min_confidence, tree)  # turn k unseen or unmatched
        if found is None:
            return Draft()
        return Draft(list(found.token_ids), list(found.probs), list(found.parents), int(found.match_len),
                     float(found.score), "history")


class FallbackDrafter:
    """The `own` and `cross` sources: per-request trees of each request's own text, and one tree of the
    responses of every request seen (bounded, oldest dropped first), both grown as tokens are emitted.

    The same structure as arctic-inference's `SuffixDecodingCache` (vLLM's `suffix` method), kept here as
    two plain trees so each source can be switched on and measured on its own."""

    def __init__(self, settings: DraftSettings) -> None:
        from arctic_inference.suffix_decoding._C import SuffixTree

        self._tree_cls = SuffixTree
        self.settings = settings
        self.depth = settings.match_tokens + settings.max_draft_tokens + 1
        self.own = "own" in settings.sources
        self.cross = "cross" in settings.sources
        self._local: dict[str, object] = {}
        self._global = SuffixTree(self.depth) if self.cross else None
        self._seq_of: dict[str, int] = {}
        self._order: list[str] = []  # labels in the global tree, oldest first
        self._next_seq = 0

    @property
    def active(self) -> bool:
        return self.own or self.cross

    def start(self, label: str, tokens: np.ndarray, prompt_len: int) -> None:
        """A request enters: its own tree gets all its tokens, the global tree its response part."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.own:
            tree = self._tree_cls(self.depth)
            tree.extend_ndarray(0, tokens)
            self._local[label] = tree
        if self.cross:
            if label in self._seq_of:
                self._global.remove(self._seq_of.pop(label))
                self._order.remove(label)
            self._seq_of[label] = self._next_seq
            self._next_seq += 1
            self._order.append(label)
            while len(self._order) > self.settings.cross_requests:
                self._global.remove(self._seq_of.pop(self._order.pop(0)))
            # The prompt's tail leads the response so a response's first tokens can be matched too.
            start = max(0, prompt_len - self.settings.match_tokens) if prompt_len else len(tokens) - 1
            self._global.extend_ndarray(self._seq_of[label], tokens[start:])

    def extend(self, label: str, new_tokens: np.ndarray) -> None:
        if not len(new_tokens):
            return
        new_tokens = np.ascontiguousarray(new_tokens, dtype=np.int32)
        if label in self._local:
            self._local[label].extend_ndarray(0, new_tokens)
        if label in self._seq_of:
            self._global.extend_ndarray(self._seq_of[label], new_tokens)

    def stop(self, label: str) -> None:
        self._local.pop(label, None)  # its response stays in the global tree until pushed out

    def draft(self, label: str, tokens: np.ndarray, max_tokens: int) -> Draft:
        """Best of the own and cross drafts continuing `tokens` (the request's sequence so far)."""
        s = self.settings
        best = Draft()
        if max_tokens <= 0 or len(tokens) == 0:
            return best
        context = np.ascontiguousarray(tokens[-(s.match_tokens + 1):], dtype=np.int32)
        for source, tree in (("own", self._local.get(label)), ("cross", self._global)):
            if tree is None:
                continue
            found = tree.speculate_ndarray(context, int(max_tokens), s.max_spec_factor, 0.0, s.min_confidence, False)
            if found.token_ids and found.score > best.score:
                best = Draft(list(found.token_ids), list(found.probs), list(found.parents), int(found.match_len),
                             float(found.score), source)
        return best
