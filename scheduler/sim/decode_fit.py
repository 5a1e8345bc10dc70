"""The decode-step fit of the simulator's calibration: engine costs from the request spans of a run's timeline.

    from scheduler.sim.decode_fit import request_spans, fit_decode
    reqs = request_spans(events, prompt_tokens, default_prompt=64.0)
    theta, fit = fit_decode(reqs, init=(0.01, 1e-4, 1e-7, 1e-5, 0.0))

The model, `s(B, C) = k_w * (a + b * B + c * C)` per decode step of engine w, and how each request gives one
equation, are described in `calibrate.py`'s docstring, which runs this fit on a run directory (tests/test_calibrate.py
checks that it recovers the simulator's own costs). Levenberg-Marquardt is written here on numpy (scipy is no
dependency). Split out of calibrate.py to keep each file small enough to hold in one's head.

Left out: reading run directories and writing scenarios (calibrate.py does both).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_sortedrl.telemetry.timeline import Event

SAMPLE_ID = re.compile(r"(.+)/e(\d+)/(\d+)")  # "<prompt>/e<epoch>/<index>"


@dataclass
class RequestSpan:
    """One request on one engine between its first token and its end, as the fit reads it."""

    worker: int
    step: int
    f: float  # first token (run clock)
    end: float  # finish or abort as recorded
    n: int  # tokens produced after the first
    context0: int  # prompt + response tokens at the first token
    finished: bool = True  # ended by finish (an equation of the fit); aborted ones only occupy the batch



def request_spans(events: Sequence[Event], prompt_tokens: dict[str, int], default_prompt: float) -> list[RequestSpan]:
    """One `RequestSpan` per request with a first_token event and a later finish/abort on the same worker."""
    first: dict[tuple[str, int], Event] = {}
    out = []
    for e in sorted((e for e in events if e.kind == "request" and e.worker is not None and e.sample_id),
                    key=lambda e: e.t):
        key = (e.sample_id, e.worker)
        if e.event == "first_token":
            first[key] = e
        elif e.event in ("finish", "abort") and key in first:
            f = first.pop(key)
            # first_token's `tokens` counts what exists then (a real engine's prefill step made one token; the
            # simulator decodes every token), so the decode steps that followed are the difference.
            k0 = f.tokens or 0
            n = (e.tokens or 0) - k0
            if n < 0:
                continue
            p = prompt_tokens.get(prompt_of_sample(e.sample_id), default_prompt)
            out.append(RequestSpan(e.worker, e.step, f.t, e.t, n, round(p) + k0, e.event == "finish"))
    return out


def prompt_of_sample(sample_id: str) -> str:
    m = SAMPLE_ID.fullmatch(sample_id)
    return m.group(1) if m else sample_id.rsplit("/", 1)[0]


def predicted_steps(reqs: list[RequestSpan], theta: Sequence[float], prompt_of: dict[int, int]) -> np.ndarray:
    """Decode steps each request sees between its first token and its (delay-corrected) end under `theta`
    = (a, b, c, pi, delta, k_1, ..., k_{W-1}): the engines' common costs and the slowdown of every engine
    but the first (sorted by index) against it; `prompt_of[i]` is request i's prompt tokens (charged as
    prefill before `f`)."""
    workers = sorted({r.worker for r in reqs})
    slow = dict(zip(workers, [1.0, *theta[5:]]))
    delta = theta[4]
    out = np.zeros(len(reqs))
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, r in enumerate(reqs):
        groups[(r.worker, r.step)].append(i)
    for (worker, _), idx in groups.items():
        a, b, c, pi = (x * slow[worker] for x in theta[:4])
        # Marks (time, kind, i); at equal times ends (kind 0) go before admissions (kind 1). A request whose
        # corrected end is not after its first token saw no decode step and is left out of the batch.
        marks = []
        for i in idx:
            r = reqs[i]
            if r.end - delta > r.f:
                marks += [(r.end - delta, 0, i), (r.f, 1, i)]
        marks.sort()
        if not marks:
            continue
        t, s, ctx, running = marks[0][0], 0.0, 0.0, 0
        start: dict[int, tuple[float, float]] = {}  # i -> (S at admission, context at admission)
        j = 0
        while j < len(marks):
            t_next = marks[j][0]
            k = j
            while k < len(marks) and marks[k][0] == t_next:
                k += 1
            same = marks[j:k]
            # The prefill of the requests admitted at t_next occupies the engine just before their first token.
            prefill = pi * sum(prompt_of[m[2]] for m in same if m[1] == 1)
            dt = t_next - t - prefill
            if running and dt > 0:
                base = a + b * running + c * ctx
                quad = c * running
                ds = 2 * dt / (base + math.sqrt(base * base + 2 * quad * dt)) if base > 0 or quad > 0 else 0.0
                s += ds
                ctx += running * ds
            t = t_next
            for _, kind, i in same:
                if kind == 0:
                    s0, c0 = start.pop(i)
                    out[i] = s - s0
                    ctx -= c0 + (s - s0)
                    running -= 1
                elif kind == 1:
                    start[i] = (s, float(reqs[i].context0))
                    ctx += reqs[i].context0
                    running += 1
            j = k
    return out


def fit_decode(reqs: list[RequestSpan], init: Sequence[float], iters: int = 60) -> tuple[np.ndarray, dict[str, float]]:
    """Least-squares (a, b, c, pi, delta, engine slowdowns) >= 0 (Levenberg-Marquardt with projection onto
    the bounds); `init` gives the first five, the slowdowns start at 1."""
    if len(reqs) < 8:
        raise UserError(f"calibration: only {len(reqs)} requests with first_token and finish events; need a "
                        "run recorded with first_token events (this version's `train`) and at least a few steps")
    prompt_of = {i: r.context0 for i, r in enumerate(reqs)}  # prefill cost ~ prompt + resumed tokens
    n = np.array([r.n for r in reqs], dtype=float)
    # Aborted requests stay in the batch but give no equation: their recorded end is the harvest (or the
    # abort's round trip), not a step boundary.
    eq = np.array([r.finished for r in reqs])
    n = n[eq]
    init = [*init[:5], *[1.0] * (len({r.worker for r in reqs}) - 1)]
    scale = np.array([max(abs(x), 1e-12) for x in init])
    scale[2] = max(scale[2], scale[0] / max(1.0, float(np.median([r.context0 for r in reqs]) * 8)))
    scale[3] = max(scale[3], scale[0] / max(1.0, float(np.median([r.context0 for r in reqs]))))
    scale[4] = max(scale[4], 1e-3)
    x = np.asarray(init, dtype=float) / scale

    def resid(x: np.ndarray) -> np.ndarray:
        return predicted_steps(reqs, np.maximum(x, 0) * scale, prompt_of)[eq] - n

    r = resid(x)
    cost, lam = float(r @ r), 1e-3
    for _ in range(iters):
        jac = np.empty((len(r), len(x)))
        for k in range(len(x)):
            h = 1e-4 * max(1.0, abs(x[k]))
            xp = x.copy()
            xp[k] += h
            jac[:, k] = (resid(xp) - r) / h
        g, hess = jac.T @ r, jac.T @ jac
        improved = False
        for _ in range(12):
            step = np.linalg.solve(hess + lam * np.diag(np.diag(hess) + 1e-9), -g)
            x_new = np.maximum(x + step, 0.0)
            r_new = resid(x_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                done = cost - c_new < 1e-10 * max(cost, 1e-12)
                x, r, cost, lam, improved = x_new, r_new, c_new, max(lam / 3, 1e-9), True
                break
            lam *= 4
        if not improved or done:
            break
    theta = np.maximum(x, 0) * scale
    total = float(n.sum())
    return theta, {"requests": int(eq.sum()), "tokens": total,
                   "decode_rel_rms": math.sqrt(cost / len(n)) / max(1.0, float(n.mean())),
                   "decode_abs_err_share": float(np.abs(r).sum() / max(1.0, total))}


def engine_jitter(reqs: list[RequestSpan], theta: Sequence[float], min_tokens: int = 64) -> float:
    """Round-to-round spread of engine speed the fitted costs do not explain: per (round, engine) the speed
    factor k = (decode steps the fit predicts) / (tokens its requests made), i.e. how much slower the engine
    ran that round than the fit; the result is the standard deviation of log k around each engine's own
    mean (its constant slowdown is fitted apart), over groups with at least `min_tokens` tokens. Simulated
    as `cluster.engine_jitter`; a steady engine gives 0."""
    pred = predicted_steps(reqs, theta, {i: r.context0 for i, r in enumerate(reqs)})
    groups: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r, p in zip(reqs, pred):
        if r.finished:
            g = groups[(r.worker, r.step)]
            g[0] += p
            g[1] += r.n
    logs: dict[int, list[float]] = defaultdict(list)
    for (worker, _), (p, n) in groups.items():
        if n >= min_tokens and p > 0:
            logs[worker].append(math.log(p / n))
    dev = [x - statistics.mean(v) for v in logs.values() if len(v) >= 2 for x in v]
    dof = len(dev) - sum(1 for v in logs.values() if len(v) >= 2)
    return math.sqrt(sum(d * d for d in dev) / dof) if dof > 0 else 0.0
