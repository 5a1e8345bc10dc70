"""Per-prompt history of the latest epochs' responses: the draft source of HistoSpec.

    store = HistoryStore(max_prompts=100_000, max_responses_per_prompt=16, keep_epochs=2)
    store.record(prompt_tokens, [response_tokens, ...], epoch=3)   # driver, after each round
    delta = store.updates_since(shipped_version)                   # only what changed
    engine.collective_rpc("histospec_update", args=(delta.to_bytes(),))
    shipped_version = delta.version
    ckpt["histospec"] = store.state_dict()                        # with the model checkpoint

The key of a prompt is a digest of its token ids (`prompt_key`), because the vLLM proposer sees token
rows, not prompt ids. Within one epoch responses accumulate (samples of a prompt finish at different
times, and the driver records each as it finishes, so siblings still running can draft from it); a newer
epoch is added in front and epochs older than the newest `keep_epochs` are dropped; a response of an
epoch older than the newest kept one is ignored (a partial rollout resumed late must not push out
fresher history). When a prompt holds `max_responses_per_prompt`, a new response replaces one of the
oldest epoch held, never one of a newer epoch. Memory is bounded by a prompt count (least recently updated prompt evicted
first), a per-prompt response cap and an optional total token cap.

Shipping is incremental: every change bumps a version, `updates_since(v)` returns the entries changed
after v and the keys evicted after v. Evictions are remembered in a bounded log; a consumer older than
the log gets a full snapshot instead (`delta.full`), so it can never silently miss an eviction.
`HistoryReplica` is the worker-side copy that applies deltas and refuses a gap.

Trajectories (a response that is assistant turns with tool messages between them, docs/agentic.md) are stored
as their generated turns only: `record(..., turn_lens=[[len(turn 0), len(turn 1), ...]])` with the tool tokens
cut out (`split_turns`), so the drafter can build one tree per turn index and never draft a tool's text. A
plain response is a trajectory of one turn. The turn lengths travel in the same payload and checkpoint
(absent in older ones: one turn per response).

Deliberately left out: cross-prompt structures (the drafter builds its cross-prompt tree from these entries) and
compression of stored tokens (int32 arrays; a 32k-token response of 16 samples is 2 MiB).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"HSPC1"


def prompt_key(prompt_tokens: Sequence[int] | np.ndarray) -> str:
    """Stable key of a prompt: blake2b-128 of its token ids as little-endian int32."""
    arr = np.ascontiguousarray(prompt_tokens, dtype="<i4")
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


def split_turns(response_tokens: Sequence[int], tool_spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """A trajectory's generated tokens (tool spans cut out) and the length of each assistant turn.

    Turn k is what lies between tool span k-1 and tool span k; a turn may be empty (kept, so turn indexes
    stay aligned with the trajectory's)."""
    tokens: list[int] = []
    lens: list[int] = []
    start = 0
    for a, b in sorted(tool_spans):
        tokens.extend(response_tokens[start:a])
        lens.append(max(0, a - start))
        start = b
    tokens.extend(response_tokens[start:])
    lens.append(max(0, len(response_tokens) - start))
    return [int(t) for t in tokens], lens


def _as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int32).reshape(-1)
    return np.ascontiguousarray(arr)


@dataclass
class HistoryEntry:
    prompt_tokens: np.ndarray  # int32, the prompt as the engine sees it
    responses: list[np.ndarray]  # int32 each, responses of the kept epochs (EOS included if sampled)
    epoch: int  # newest epoch recorded
    version: int  # store version of the last change
    response_epochs: list[int] = field(default_factory=list)  # epoch of each response (empty: all `epoch`)
    response_turns: list[list[int]] = field(default_factory=list)  # turn lengths per response (empty: one turn)

    def epochs(self) -> list[int]:
        """Epoch of each response (entries from an older payload carry only the newest epoch)."""
        if len(self.response_epochs) == len(self.responses):
            return list(self.response_epochs)
        return [self.epoch] * len(self.responses)

    def turn_lengths(self) -> list[list[int]]:
        """Lengths of each response's generated turns (a plain response: one turn, its whole length)."""
        if len(self.response_turns) == len(self.responses):
            return [list(t) if t else [len(r)] for t, r in zip(self.response_turns, self.responses)]
        return [[len(r)] for r in self.responses]

    @property
    def num_tokens(self) -> int:
        return int(sum(len(r) for r in self.responses))


@dataclass
class HistoryDelta:
    """What changed in a store between two versions; a full snapshot when `full`."""

    since: int  # consumer's version this delta applies to
    version: int  # store version after applying it
    full: bool  # True: replace everything (consumer too old, or a fresh checkpoint)
    entries: dict[str, HistoryEntry] = field(default_factory=dict)
    evicted: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries) + len(self.evicted)

    def to_bytes(self) -> bytes:
        """Compact wire format: magic, header length, JSON header, then all tokens as int32."""
        keys = list(self.entries)
        header = {
            "since": self.since, "version": self.version, "full": self.full, "evicted": self.evicted,
            "keys": keys,
            "epochs": [self.entries[k].epoch for k in keys],
            "versions": [self.entries[k].version for k in keys],
            "prompt_lens": [len(self.entries[k].prompt_tokens) for k in keys],
            "response_lens": [[len(r) for r in self.entries[k].responses] for k in keys],
            "response_epochs": [self.entries[k].epochs() for k in keys],
            # one turn per response is written as [] (the common case costs nothing)
            "response_turns": [[t if len(t) > 1 else [] for t in self.entries[k].turn_lengths()] for k in keys],
        }
        parts = []
        for k in keys:
            parts.append(self.entries[k].prompt_tokens)
            parts.extend(self.entries[k].responses)
        tokens = np.concatenate(parts).astype("<i4") if parts else np.zeros(0, "<i4")
        head = json.dumps(header, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<Q", len(head)) + head + tokens.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> HistoryDelta:
        if not data.startswith(MAGIC):
            raise ValueError("not a HistoSpec history payload (bad magic)")
        (n,) = struct.unpack_from("<Q", data, len(MAGIC))
        start = len(MAGIC) + 8
        header = json.loads(data[start:start + n])
        tokens = np.frombuffer(data, dtype="<i4", offset=start + n).astype(np.int32)
        entries, pos = {}, 0
        repochs = header.get("response_epochs") or [[] for _ in header["keys"]]  # absent in older payloads
        rturns = header.get("response_turns") or [[] for _ in header["keys"]]  # absent: one turn per response
        for key, epoch, version, plen, rlens, rep, rt in zip(header["keys"], header["epochs"], header["versions"],
                                                              header["prompt_lens"], header["response_lens"], repochs,
                                                              rturns):
            prompt = tokens[pos:pos + plen]
            pos += plen
            responses = []
            for rl in rlens:
                responses.append(tokens[pos:pos + rl])
                pos += rl
            turns = [list(t) for t in rt] if len(rt) == len(responses) else []
            if any(t and sum(t) != len(r) for t, r in zip(turns, responses)):
                raise ValueError(f"history payload: turn lengths of prompt {key} do not add up to its responses")
            entries[key] = HistoryEntry(prompt, responses, epoch, version, list(rep), turns)
        if pos != len(tokens):
            raise ValueError(f"history payload has {len(tokens) - pos} trailing tokens")
        return cls(header["since"], header["version"], header["full"], entries, list(header["evicted"]))


class HistoryStore:
    """Driver-side store: per prompt key, the latest epochs' responses (see module docstring)."""

    def __init__(self, max_prompts: int = 100_000, max_responses_per_prompt: int = 16,
                 max_total_tokens: int = 0, eviction_log_size: int | None = None, keep_epochs: int = 1) -> None:
        if max_prompts < 1 or max_responses_per_prompt < 1 or max_total_tokens < 0 or keep_epochs < 1:
            raise ValueError("max_prompts, max_responses_per_prompt and keep_epochs must be >= 1, "
                             "max_total_tokens >= 0")
        self.keep_epochs = keep_epochs
        self.max_prompts = max_prompts
        self.max_responses_per_prompt = max_responses_per_prompt
        self.max_total_tokens = max_total_tokens  # 0: no token cap
        self._log_size = eviction_log_size if eviction_log_size is not None else max(1024, 4 * max_prompts)
        self._entries: OrderedDict[str, HistoryEntry] = OrderedDict()  # least recently updated first
        self._evicted: OrderedDict[str, int] = OrderedDict()  # key -> version of its eviction, oldest first
        self._horizon = 0  # consumers at a version below this may have missed an eviction
        self._version = 0
        self._total_tokens = 0

    # -- reading ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def total_tokens(self) -> int:
        return self._total_tokens

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, prompt: object) -> bool:
        return self._key(prompt) in self._entries

    def get(self, prompt: str | Sequence[int] | np.ndarray) -> HistoryEntry | None:
        return self._entries.get(self._key(prompt))

    def keys(self) -> list[str]:
        return list(self._entries)

    @staticmethod
    def _key(prompt: object) -> str:
        return prompt if isinstance(prompt, str) else prompt_key(prompt)  # type: ignore[arg-type]

    # -- writing ------------------------------------------------------------------------------------
    def record(self, prompt_tokens: Sequence[int] | np.ndarray, responses: Iterable[Sequence[int]],
               epoch: int, turn_lens: Sequence[Sequence[int]] | None = None) -> str:
        """Adds responses of `epoch` for this prompt; returns the prompt's key. `turn_lens[i]`: the lengths of
        response i's generated turns when it is a trajectory (tool tokens already cut out, `split_turns`)."""
        prompt = _as_tokens(prompt_tokens)
        rs = [_as_tokens(r) for r in responses]
        tl = [list(map(int, t)) for t in turn_lens] if turn_lens is not None else [[] for _ in rs]
        if len(tl) != len(rs) or any(t and sum(t) != len(r) for t, r in zip(tl, rs)):
            raise ValueError("turn_lens must give one list per response, adding up to the response's length")
        kept_new = [(r, t if len(t) > 1 else []) for r, t in zip(rs, tl) if len(r)]
        new = [r for r, _ in kept_new]
        key = prompt_key(prompt)
        entry = self._entries.get(key)
        if entry is not None and epoch <= entry.epoch - self.keep_epochs:
            return key  # stale: older than every epoch this prompt keeps
        if not new:
            return key
        self._version += 1
        if entry is None:
            entry = HistoryEntry(prompt, [], epoch, self._version, [])
            self._entries[key] = entry
        epochs = entry.epochs()
        turns = [t if len(t) > 1 else [] for t in entry.turn_lengths()]
        if epoch > entry.epoch:  # a newer epoch: drop the epochs that fall out of the window
            floor = epoch - self.keep_epochs
            kept_old = [(r, e, t) for r, e, t in zip(entry.responses, epochs, turns) if e > floor]
            self._total_tokens -= entry.num_tokens
            entry.responses = [r for r, _, _ in kept_old]
            epochs, turns = [e for _, e, _ in kept_old], [t for _, _, t in kept_old]
            self._total_tokens += entry.num_tokens
            entry.epoch = epoch
        for r, t in kept_new:
            if len(entry.responses) >= self.max_responses_per_prompt:
                oldest = min(epochs)
                if oldest >= epoch:
                    break  # full of responses at least as new: keep the first ones (as before)
                i = epochs.index(oldest)
                self._total_tokens -= len(entry.responses.pop(i))
                epochs.pop(i)
                turns.pop(i)
            entry.responses.append(r)
            epochs.append(epoch)
            turns.append(t)
            self._total_tokens += len(r)
        entry.response_epochs = epochs
        entry.response_turns = turns if any(turns) else []
        entry.version = self._version
        self._entries.move_to_end(key)
        self._evicted.pop(key, None)
        self._evict_over_budget(protect=key)
        return key

    def evict(self, prompt: str | Sequence[int] | np.ndarray) -> bool:
        key = self._key(prompt)
        if key not in self._entries:
            return False
        self._version += 1
        self._drop(key)
        return True

    def _evict_over_budget(self, protect: str) -> None:
        while len(self._entries) > self.max_prompts or (
                self.max_total_tokens and self._total_tokens > self.max_total_tokens and len(self._entries) > 1):
            oldest = next(iter(self._entries))
            if oldest == protect:
                break
            self._drop(oldest)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._total_tokens -= entry.num_tokens
        self._evicted[key] = self._version
        while len(self._evicted) > self._log_size:
            _, v = self._evicted.popitem(last=False)
            self._horizon = max(self._horizon, v)

    # -- shipping -----------------------------------------------------------------------------------
    def updates_since(self, version: int) -> HistoryDelta:
        """Entries changed and keys evicted after `version` (a full snapshot if that is too old)."""
        if version > self._version:
            raise ValueError(f"consumer version {version} is ahead of the store ({self._version})")
        if version < self._horizon:
            return self.snapshot()
        changed: dict[str, HistoryEntry] = {}
        for key in reversed(self._entries):  # most recently updated first; stop at the first unchanged
            entry = self._entries[key]
            if entry.version <= version:
                break
            changed[key] = entry
        evicted = []
        for key in reversed(self._evicted):
            if self._evicted[key] <= version:
                break
            evicted.append(key)
        return HistoryDelta(version, self._version, False, dict(reversed(list(changed.items()))), evicted)

    def snapshot(self) -> HistoryDelta:
        return HistoryDelta(0, self._version, True, dict(self._entries), [])

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": 1, "version": self._version, "snapshot": self.snapshot().to_bytes(),
                "max_prompts": self.max_prompts, "max_responses_per_prompt": self.max_responses_per_prompt,
                "max_total_tokens": self.max_total_tokens, "keep_epochs": self.keep_epochs}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != 1:
            raise ValueError(f"unknown history state format {state.get('format')!r}")
        delta = HistoryDelta.from_bytes(state["snapshot"])
        self._entries = OrderedDict(sorted(delta.entries.items(), key=lambda kv: kv[1].version))
        self._total_tokens = sum(e.num_tokens for e in self._entries.values())
        self._version = int(state["version"])
        self._evicted = OrderedDict()
        # The eviction log is not saved: every consumer of the restored store must start from a snapshot.
        self._horizon = self._version
        self._evict_over_budget(protect="")


class HistoryReplica:
    """Consumer-side copy (one per vLLM worker): applies deltas in order, refuses gaps."""

    def __init__(self) -> None:
        self.version = 0
        self.entries: dict[str, HistoryEntry] = {}

    def apply(self, delta: HistoryDelta) -> tuple[list[str], list[str]]:
        """Applies `delta`; returns (changed keys, removed keys) so a drafter can update its index."""
        if delta.full:
            removed = [k for k in self.entries if k not in delta.entries]
            self.entries = dict(delta.entries)
        else:
            if delta.since > self.version:
                raise ValueError(f"history delta starts at version {delta.since} but this replica is at "
                                 f"{self.version}: an update was missed; send updates_since({self.version})")
            removed = [k for k in delta.evicted if self.entries.pop(k, None) is not None]
            self.entries.update(delta.entries)
        self.version = max(self.version, delta.version) if not delta.full else delta.version
        return list(delta.entries), removed
