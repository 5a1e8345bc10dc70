"""When does verifying drafts pay? A per-step gate that measures it: time per generated token with and without
drafts, per batch-size bucket, on the engine itself.

    gate = StepCostGate()
    draft = gate.decide(rows=128)                     # propose drafts in this step, or decode plainly
    ...                                               # the engine runs the step
    gate.observe(rows=128, drafted=draft, tokens=131, seconds=0.021)   # what that step emitted, how long it took

Why measured and not modelled. Verification widens a step by its draft tokens: nearly free with a few rows
(the long tail), a real cost in a full batch, and whether the accepted tokens repay it depends on the
acceptance (which moves as the policy learns) and on how the engine's step time grows with its tokens. A
linear cost model fitted online was tried first: on the tiny CPU engine the step time is flat at small
batches and steep at large ones, so the slope fitted on the tail's steps said drafting paid at 64 rows, where
a drafted step took 43 ms against 9 plain and rollout ran 2x slower. So the gate compares the two arms
directly: for each bucket of running rows (1, 2-3, 4-7, ..., powers of two) it keeps the seconds per
generated token of the last `window` steps with drafts and of the last `window` without, and drafts where
the drafted median is lower. Medians, because a step that also served a history shipment or shared the core
with another process is an outlier, and a mean moved by one such step would keep the gate on the wrong arm
until the other arm was sampled again. Until a bucket has `min_samples` steps of each arm it alternates
between them; afterwards every `explore_every`-th step of a bucket takes the other arm, so a change of
acceptance (drift) or of the engine's load is noticed. A step with a single row always drafts (a verified
token is nearly free there, and the acceptance keeps being measured).

The gate only decides whether drafts are proposed; verification stays vLLM's rejection sampler, so the
output distribution is unchanged (lossless) whichever way it decides.

Written here: no library measures this inside a vLLM proposer. Left out: choosing a draft length per bucket
(the gate is on/off per step; HistoSpec's confidence still ends each draft).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepCostGate"]


def bucket(rows: int) -> int:
    """0 for one row, 1 for 2-3, 2 for 4-7, ...: floor(log2(rows))."""
    return max(rows, 1).bit_length() - 1


class StepCostGate:
    def __init__(self, min_samples: int = 4, explore_every: int = 16, window: int = 9) -> None:
        if min_samples < 1 or explore_every < 2 or window < min_samples:
            raise ValueError("need min_samples >= 1, explore_every >= 2, window >= min_samples")
        self.min_samples, self.explore_every, self.window = min_samples, explore_every, window
        # bucket -> recent seconds per token for arm False (plain) and True (drafts)
        self.cost: dict[int, dict[bool, deque[float]]] = {}
        self.decisions: dict[int, int] = {}  # bucket -> decisions taken (for the exploration schedule)

    def _arms(self, b: int) -> dict[bool, deque[float]]:
        return self.cost.setdefault(b, {False: deque(maxlen=self.window), True: deque(maxlen=self.window)})

    def preferred(self, rows: int) -> bool | None:
        """The cheaper arm in this bucket, or None while either arm has fewer than `min_samples` steps."""
        arms = self._arms(bucket(rows))
        if min(len(arms[False]), len(arms[True])) < self.min_samples:
            return None
        return statistics.median(arms[True]) < statistics.median(arms[False])

    def decide(self, rows: int) -> bool:
        if rows <= 1:
            return True
        b = bucket(rows)
        k = self.decisions.get(b, 0)
        self.decisions[b] = k + 1
        best = self.preferred(rows)
        if best is None:  # still learning this bucket: the arm with fewer samples
            arms = self._arms(b)
            return len(arms[True]) < len(arms[False]) if len(arms[True]) != len(arms[False]) else k % 2 == 0
        return (not best) if k % self.explore_every == self.explore_every - 1 else best

    def observe(self, rows: int, drafted: bool, tokens: float, seconds: float) -> None:
        """One clean engine step: it ran `rows` rows with or without drafts, emitted `tokens`, took `seconds`."""
        if rows < 1 or tokens <= 0 or seconds <= 0:
            return
        self._arms(bucket(rows))[bool(drafted)].append(seconds / tokens)

    def state(self) -> dict[str, dict[str, float]]:
        """Per bucket (its smallest row count): median ms per token plain / drafted, and recent samples of each."""
        med = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
        return {str(1 << b): {"plain_ms": med(a[False]), "drafted_ms": med(a[True]), "plain_n": len(a[False]),
                              "drafted_n": len(a[True])} for b, a in sorted(self.cost.items())}
