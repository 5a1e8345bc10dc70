"""Per-prompt history of response lengths and the length predictor built on it.

    from scheduler.history import LengthHistory
    h = LengthHistory(predictor="prev_max")
    h.record("p17", epoch=0, length=812)        # every finished sample, all n of them
    h.predict("p17")                            # -> 812.0; unseen prompts get the dataset-wide fallback

What it keeps: for each prompt, the lengths of its finished samples in the last `keep_epochs` epochs and
a lower bound from aborted samples (an aborted sample that reached L tokens says the prompt runs at least
L long). Memory is bounded: at most `max_prompts` prompts (least recently recorded evicted) and a ring of
`global_window` recent lengths for the dataset-wide fallback. `state_dict()` is plain JSON.

Rewards join the same store (`record_rewards`): per prompt, the rewards of its latest complete group and
the *streak*, how many of its most recent epochs in a row gave a group whose rewards were all equal (an
uninformative group: zero group-relative advantage). `scheduler/selective.py` skips prompts by it. Bounded
by the same `max_prompts` (least recently recorded evicted) and saved in the same `state_dict()`.

Trajectories (multi-turn, tool-using samples; `record(..., turns=, tool_s=)`): per prompt, the same window
of epochs also keeps each finished trajectory's (tokens, turns, tool seconds), and `predict_cost` turns them into
one number in token units, the trajectory's critical path: tokens + `tokens_per_tool_s` x tool seconds, where
`tokens_per_tool_s` is how many tokens one sequence decodes in a second (a tool second holds the sample back as
long as that many tokens would), per recorded trajectory and then the predictor over them. A prompt with no
trajectory record predicts as above (`predict`), so single-turn runs are unchanged. `predict_trajectory` gives
the three parts apart (tokens, turns, tool seconds).

Left out: per-token history (that lives in speculative/, which keeps the responses themselves) and any
learned predictor; the papers report that the previous epoch's lengths already predict well.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

PREDICTORS = ("prev_max", "prev_mean", "quantile")


def quantile(values: list[float] | list[int], q: float) -> float:
    """Nearest-rank quantile (q in (0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


class LengthHistory:
    def __init__(self, predictor: str = "prev_max", quantile_q: float = 0.9, max_prompts: int = 1_000_000,
                 keep_epochs: int = 2, global_window: int = 8192) -> None:
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor={predictor!r}; expected one of {PREDICTORS}")
        self.predictor, self.q = predictor, quantile_q
        self.max_prompts, self.keep_epochs = max_prompts, keep_epochs
        # prompt_id -> {epoch: [lengths]}; OrderedDict order is recency of the last record (LRU eviction).
        self._lengths: OrderedDict[str, dict[int, list[int]]] = OrderedDict()
        self._lower: dict[str, int] = {}  # prompt_id -> longest aborted partial seen (tokens)
        self._recent: deque[int] = deque(maxlen=global_window)
        # prompt_id -> [last epoch with a complete group, uninformative streak, that group's rewards]; LRU order.
        self._rewards: OrderedDict[str, list[Any]] = OrderedDict()
        # prompt_id -> {epoch: [[tokens, turns, tool_s], ...]} for trajectories (same epochs and LRU as _lengths),
        # and a ring of recent ones for the fallback of unseen prompts.
        self._traj: OrderedDict[str, dict[int, list[list[float]]]] = OrderedDict()
        self._recent_traj: deque[list[float]] = deque(maxlen=global_window)

    # -- recording ----------------------------------------------------------------------------------------

    def record(self, prompt_id: str, epoch: int, length: int, turns: int | None = None,
               tool_s: float | None = None) -> None:
        """One finished sample of `prompt_id` in `epoch` had `length` response tokens; a trajectory also gives its
        assistant `turns` and the seconds its tool calls took (`tool_s`)."""
        if turns is not None or tool_s is not None:
            rec = [int(length), int(turns or 1), float(tool_s or 0.0)]
            per = self._traj.pop(prompt_id, {})
            per.setdefault(epoch, []).append(rec)
            for old in sorted(per)[: -self.keep_epochs]:
                del per[old]
            self._traj[prompt_id] = per
            self._recent_traj.append(rec)
            while len(self._traj) > self.max_prompts:
                self._traj.popitem(last=False)
        per_epoch = self._lengths.pop(prompt_id, {})
        per_epoch.setdefault(epoch, []).append(int(length))
        for old in sorted(per_epoch)[: -self.keep_epochs]:
            del per_epoch[old]
        self._lengths[prompt_id] = per_epoch
        self._recent.append(int(length))
        while len(self._lengths) > self.max_prompts:
            evicted, _ = self._lengths.popitem(last=False)
            self._lower.pop(evicted, None)

    def record_lower_bound(self, prompt_id: str, tokens: int) -> None:
        """An aborted sample of `prompt_id` had already generated `tokens`: its length is at least that."""
        if tokens > self._lower.get(prompt_id, 0):
            self._lower[prompt_id] = int(tokens)
            if len(self._lower) > self.max_prompts:  # bounded even for prompts that never finish
                self._lower.pop(next(iter(self._lower)))

    def record_rewards(self, prompt_id: str, epoch: int, rewards: list[float]) -> None:
        """The complete group of `prompt_id` in `epoch` scored `rewards` (trained or filtered alike)."""
        last, streak, _ = self._rewards.pop(prompt_id, [-1, 0, []])
        uninformative = len(set(rewards)) <= 1
        if epoch != last:  # a prompt has one group per epoch; a repeat record only refreshes the rewards
            streak = streak + 1 if uninformative else 0
        self._rewards[prompt_id] = [epoch, streak, [float(r) for r in rewards]]
        while len(self._rewards) > self.max_prompts:
            self._rewards.popitem(last=False)

    def reward_streak(self, prompt_id: str) -> int:
        """Consecutive most recent epochs whose group of this prompt was uninformative (0: unseen or informative)."""
        rec = self._rewards.get(prompt_id)
        return rec[1] if rec else 0

    def last_rewards(self, prompt_id: str) -> list[float]:
        rec = self._rewards.get(prompt_id)
        return list(rec[2]) if rec else []

    # -- queries ------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._lengths)

    def __contains__(self, prompt_id: str) -> bool:
        return prompt_id in self._lengths

    def known(self, prompt_id: str) -> bool:
        """Whether anything was recorded about this prompt (a finished sample or an aborted partial)."""
        return prompt_id in self._lengths or prompt_id in self._lower

    def lengths(self, prompt_id: str, epoch: int | None = None) -> list[int]:
        """Recorded lengths of one epoch (default: the latest epoch with records)."""
        per_epoch = self._lengths.get(prompt_id)
        if not per_epoch:
            return []
        return list(per_epoch.get(max(per_epoch) if epoch is None else epoch, []))

    def fallback(self) -> float:
        """Prediction for an unseen prompt, from the dataset-wide recent lengths (0.0 before any record)."""
        recent = list(self._recent)
        if not recent:
            return 0.0
        if self.predictor == "prev_mean":
            return sum(recent) / len(recent)
        return quantile(recent, self.q)

    def predict(self, prompt_id: str) -> float:
        """Predicted response length in tokens from the latest epoch with records, raised to any lower bound."""
        seen = self.lengths(prompt_id)
        if not seen:
            guess = self.fallback()
        elif self.predictor == "prev_max":
            guess = float(max(seen))
        elif self.predictor == "prev_mean":
            guess = sum(seen) / len(seen)
        else:
            guess = quantile(seen, self.q)
        return max(guess, float(self._lower.get(prompt_id, 0)))

    def _pick(self, values: list[float]) -> float:
        if self.predictor == "prev_max":
            return float(max(values))
        if self.predictor == "prev_mean":
            return sum(values) / len(values)
        return quantile(values, self.q)

    def _trajectories(self, prompt_id: str) -> list[list[float]]:
        per = self._traj.get(prompt_id)
        return per[max(per)] if per else []

    def predict_trajectory(self, prompt_id: str) -> dict[str, float]:
        """Predicted tokens, turns and tool seconds of a trajectory of `prompt_id`, each by the predictor over the
        latest epoch's trajectories (the dataset-wide recent ones for an unseen prompt; zeros before any)."""
        recs = self._trajectories(prompt_id) or list(self._recent_traj)
        if not recs:
            return {"tokens": self.predict(prompt_id), "turns": 1.0, "tool_s": 0.0}
        return {"tokens": max(self._pick([r[0] for r in recs]), float(self._lower.get(prompt_id, 0))),
                "turns": self._pick([r[1] for r in recs]), "tool_s": self._pick([r[2] for r in recs])}

    def predict_cost(self, prompt_id: str, tokens_per_tool_s: float) -> float:
        """Predicted critical path of a trajectory of `prompt_id` in token units (module docstring); exactly
        `predict` while no trajectory was recorded (single-turn runs)."""
        if not self._recent_traj:
            return self.predict(prompt_id)
        recs = self._trajectories(prompt_id) or list(self._recent_traj)
        guess = self._pick([r[0] + tokens_per_tool_s * r[2] for r in recs])
        return max(guess, float(self._lower.get(prompt_id, 0)))

    # -- checkpointing ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor, "quantile": self.q,
            "lengths": [[pid, {str(e): v for e, v in per.items()}] for pid, per in self._lengths.items()],
            "lower": dict(self._lower), "recent": list(self._recent),
            "rewards": [[pid, rec] for pid, rec in self._rewards.items()],
            **({"trajectories": [[pid, {str(e): v for e, v in per.items()}] for pid, per in self._traj.items()],
                "recent_trajectories": list(self._recent_traj)} if self._recent_traj else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lengths = OrderedDict((pid, {int(e): list(v) for e, v in per.items()}) for pid, per in state["lengths"])
        self._lower = {k: int(v) for k, v in state.get("lower", {}).items()}
        self._recent = deque(state.get("recent", []), maxlen=self._recent.maxlen)
        self._rewards = OrderedDict((pid, [int(r[0]), int(r[1]), [float(x) for x in r[2]]])
                                    for pid, r in state.get("rewards", []))
        self._traj = OrderedDict((pid, {int(e): [list(r) for r in v] for e, v in per.items()})
                                 for pid, per in state.get("trajectories", []))
        self._recent_traj = deque((list(r) for r in state.get("recent_trajectories", [])), maxlen=self._recent.maxlen)
