"""Elastic layout planners: the engine layout (TP per engine, number of engines) for each round.

    planner = make_planner("cost_model", gpus=128, gpus_per_node=8, tp_short=4, tp_long=8, model=engine_cost)
    layout = planner.plan("long", predicted_lengths, prompt_len)       # -> Layout(tp=8, num_engines=16)
    planner.observe(preemptions)                                       # after each round

- `fixed`: `tp_short` for sync and short rounds, `tp_long` for long rounds.
- `preemption` (RollPacker's heuristic, the baseline): one TP for every round; double it when the last
  round's KV preemptions jumped (more than `jump` times the previous round's and at least `min_jump`),
  halve it after `quiet_rounds` rounds without preemptions. Never below the smallest TP that holds the
  weights, never above one node (a TP group does not span nodes).
- `cost_model` (ours): for each candidate TP (powers of two up to a node) estimate the round's time with
  `EngineCostModel.estimate_round_s` from the predicted lengths, add the re-layout cost when it differs
  from the current layout, and take the fastest. A round without predictions (all 0) keeps the layout.

Left out: pipeline-parallel rollout engines and mixed layouts within one round.
"""

from __future__ import annotations

from typing import Any

from scheduler.cost_model import EngineCostModel
from scheduler.protocol import Layout

LAYOUT_PLANNERS = ("fixed", "preemption", "cost_model")


class FixedPlanner:
    def __init__(self, gpus: int, gpus_per_node: int, tp_short: int, tp_long: int,
                 model: EngineCostModel | None = None, relayout_s: float = 0.0) -> None:
        self.gpus, self.gpus_per_node = gpus, max(1, gpus_per_node)
        self.model = model
        floor = model.min_tp() if model else 1
        self.tp_short, self.tp_long = self._clamp(max(tp_short, floor)), self._clamp(max(tp_long, floor))
        self.relayout_s = relayout_s
        self.current: Layout | None = None

    def _clamp(self, tp: int) -> int:
        return max(1, min(tp, self.gpus_per_node, self.gpus))

    def layout(self, tp: int) -> Layout:
        return Layout(tp=tp, num_engines=max(1, self.gpus // tp))

    def plan(self, kind: str, predicted: list[float], prompt_len: float) -> Layout:
        self.current = self.layout(self.tp_long if kind == "long" else self.tp_short)
        return self.current

    def observe(self, preemptions: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current.to_dict() if self.current else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = Layout(**state["current"]) if state.get("current") else None


class PreemptionPlanner(FixedPlanner):
    """RollPacker's rule: TP doubles on a preemption jump and halves after quiet rounds."""

    def __init__(self, *args: Any, jump: float = 2.0, min_jump: int = 8, quiet_rounds: int = 3, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tp, self.jump, self.min_jump, self.quiet_rounds = self.tp_short, jump, min_jump, quiet_rounds
        self.last_preemptions, self.quiet = 0, 0

    def plan(self, kind: str, predicted: list[float], prompt_len: float) -> Layout:
        self.current = self.layout(self.tp)
        return self.current

    def observe(self, preemptions: int) -> None:
        if preemptions >= self.min_jump and preemptions > self.jump * max(1, self.last_preemptions):
            self.tp, self.quiet = self._clamp(self.tp * 2), 0
        elif preemptions == 0:
            self.quiet += 1
            if self.quiet >= self.quiet_rounds and self.tp > self.tp_short:
                self.tp, self.quiet = max(self.tp_short, self.tp // 2), 0
        else:
            self.quiet = 0
        self.last_preemptions = preemptions

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tp": self.tp, "last": self.last_preemptions, "quiet": self.quiet}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.tp, self.last_preemptions, self.quiet = state["tp"], state["last"], state["quiet"]


class CostModelPlanner(FixedPlanner):
    """Picks the TP with the smallest estimated round time (plus re-layout cost)."""

    def candidates(self) -> list[int]:
        tps, tp = [], self.model.min_tp() if self.model else 1
        while tp <= min(self.gpus_per_node, self.gpus):
            tps.append(tp)
            tp *= 2
        return tps or [self._clamp(self.tp_short)]

    def plan(self, kind: str, predicted: list[float], prompt_len: float) -> Layout:
        if self.model is None or not any(predicted):
            # No prediction (a round before any length was recorded predicts 0): nothing to choose by, so no
            # switch; the first round takes the fixed layout.
            return self.current if self.current is not None else super().plan(kind, predicted, prompt_len)

        def total(tp: int) -> float:
            layout = self.layout(tp)
            switch = self.relayout_s if self.current is not None and layout != self.current else 0.0
            return self.model.estimate_round_s(tp, layout.num_engines, predicted, prompt_len) + switch

        self.current = self.layout(min(self.candidates(), key=total))
        return self.current


def make_planner(name: str, **kw: Any) -> FixedPlanner:
    classes = {"fixed": FixedPlanner, "preemption": PreemptionPlanner, "cost_model": CostModelPlanner}
    if name not in classes:
        raise ValueError(f"layout_planner={name!r}; expected one of {LAYOUT_PLANNERS}")
    return classes[name](**kw)
