"""When does verifying a draft pay? A per-step gate from the engine's own step cost and the drafts' acceptance.

    gate = StepCostGate(prior_ratio=64.0)
    gate.observe(tokens=130, seconds=0.021)          # each clean engine step: tokens it processed, its duration
    gate.observe_acceptance(verified=40, accepted=9)
    if gate.open(rows=128): ...                       # propose drafts in this step, or decode plainly

Model. An engine step that processes T tokens (one per running row plus the rows' draft tokens) takes
a + b T seconds: a fixed part (kernel launches, scheduling, sampling, on CPU the Python around the forward)
and a part per token. Without drafts a step of R rows costs a + b R and yields R tokens. With D draft tokens
whose share p is accepted it costs a + b (R + D) and yields R + p D. Drafting lowers the cost per token iff

    (a + b (R + D)) / (R + p D) < (a + b R) / R   <=>   R < (a / b) * p / (1 - p)

whatever D is. So a step drafts while its running rows are fewer than that: a verified token is nearly free
with a few rows (the long tail) and costs as much as a decoded one in a full batch. a / b (the tokens a step
could add for the price of its fixed part) is fitted online, by least squares with exponential forgetting,
on (T, duration) of clean steps (no request starting or prefilling); until enough steps are seen it is
`prior_ratio`. p is the share of verified draft tokens accepted over recent steps. Measured here: the tiny CPU
engine's a / b is about 20 tokens (3.1 ms at batch 1, 12.5 ms at batch 64); on a GPU it is hundreds. A step
with a single row always drafts, so the acceptance keeps being measured (in the tail) even where the gate
closed every full batch.

The gate only decides whether drafts are proposed; verification stays vLLM's rejection sampler, so the
output distribution is unchanged (lossless) whichever way it decides.

Written here: no library fits a step cost model inside a vLLM proposer. Left out: per-position acceptance
(the marginal draft token of a long draft is accepted less often than the first; the gate uses the mean).
"""

from __future__ import annotations

__all__ = ["StepCostGate"]


class StepCostGate:
    def __init__(self, prior_ratio: float = 64.0, decay: float = 0.99, min_steps: int = 32,
                 prior_acceptance: float = 0.5, acceptance_decay: float = 0.9) -> None:
        if prior_ratio <= 0 or not 0 < decay <= 1 or min_steps < 2 or not 0 < prior_acceptance < 1:
            raise ValueError("need prior_ratio > 0, 0 < decay <= 1, min_steps >= 2, 0 < prior_acceptance < 1")
        self.prior_ratio, self.decay, self.min_steps = prior_ratio, decay, min_steps
        self.acceptance_decay = acceptance_decay
        # exponentially weighted sums for y = a + b x
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.steps = 0
        self._verified, self._accepted = 1.0, prior_acceptance  # a prior worth one verified token

    # -- measurements ---------------------------------------------------------------------------------
    def observe(self, tokens: float, seconds: float) -> None:
        """One clean engine step: `tokens` processed in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + tokens * tokens
        self._sxy = d * self._sxy + tokens * seconds
        self.steps += 1

    def observe_acceptance(self, verified: float, accepted: float) -> None:
        if verified <= 0:
            return
        d = self.acceptance_decay
        self._verified = d * self._verified + verified
        self._accepted = d * self._accepted + accepted

    # -- estimates ------------------------------------------------------------------------------------
    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds and seconds per token, or None while too few or too alike steps were seen."""
        if self.steps < self.min_steps:
            return None
        w = self._w
        var = self._sxx / w - (self._sx / w) ** 2
        if var <= 1e-9 * max(1.0, (self._sx / w) ** 2):
            return None  # every step had the same size: the slope is unknown
        b = (self._sxy / w - (self._sx / w) * (self._sy / w)) / var
        a = self._sy / w - b * self._sx / w
        if b <= 0:
            return None  # noise bigger than the per-token cost: no evidence either way
        return max(a, 0.0), b

    @property
    def ratio(self) -> float:
        """a / b: the tokens a step could add for the price of its fixed part."""
        ab = self.fit()
        return self.prior_ratio if ab is None else ab[0] / ab[1]

    @property
    def acceptance(self) -> float:
        return min(max(self._accepted / self._verified, 0.0), 1.0)

    def max_rows(self) -> float:
        """Running rows below which drafting pays: (a / b) p / (1 - p)."""
        p = self.acceptance
        return float("inf") if p >= 1.0 else self.ratio * p / (1.0 - p)

    def open(self, rows: int) -> bool:
        return rows <= 1 or rows < self.max_rows()
