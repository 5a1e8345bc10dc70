"""HistoSpec in the cluster simulator: tokens per target forward and verification cost per request.

    sim, run = load_sim_config("configs/sim_qwen32b_128gpu.yaml")
    simulate(sim, run, "twotier+histospec")                      # a `+histospec` policy name turns it on
    python -m scheduler.sim.speculation_model docs/benchmarks/histospec_benchmark.json runs/tiny_cpu [RUN_DIR ...]
        # refits the acceptance curve from real measurements, prints it and writes
        # docs/benchmarks/histospec_sim_calibration.json (the numbers the sim YAMLs carry)

Model, as the engines run HistoSpec (docs/speculative.md):

- **History age.** Finished samples are recorded per prompt (same epoch accumulates, a newer epoch replaces,
  an older one is ignored) and reach the drafters at the next round, as the driver ships them after each
  round. A request whose prompt has no history runs without drafts. Its history's *age* is the number of
  policy versions since the recorded samples finished.
- **Acceptance.** The chance that one draft token is accepted decays with the age of the history:
  ``alpha(a) = alpha_inf + (alpha_0 - alpha_inf) * exp(-(a / tau_versions)^shape)``; each request draws its own
  ``alpha_r = alpha(a) * (1 + jitter * u)``, u uniform in [-1, 1] seeded by the sample's coordinates (all
  policies see the same draws), capped at `alpha_cap`.
- **Draft length** follows the engines' adaptive rule: start at `min_draft_tokens`, double after a fully
  accepted draft (cap `max_draft_tokens`), halve otherwise. With a per-token acceptance ``alpha`` a draft of
  k tokens emits ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens in expectation (accepted ones plus the bonus or
  correcting token); the stationary distribution of the length chain gives the request's expected tokens
  per target forward (`rate`) and draft tokens verified per forward (`drafted`). The simulator advances the
  request by `rate` tokens per engine step (expected values, not a sampled accept sequence).
- **Verification cost.** An engine step verifies ``1 + drafted`` positions per sequence: the engine cost
  model's decode step with that many positions (`EngineCostModel.verify_step_s`: weights and KV read once,
  per-position compute), plus the drafter's own time per step (`drafter_s_per_step`, measured on CPU).
  So a draft is almost free when few sequences run (memory bound: the long tail) and costs compute when
  the batch is full.

Calibration (`calibrate`): measured tokens per target forward at known ages (what sets decode time) are
converted to per-token ``alpha`` by inverting the chain, and the decay curve is fitted by least squares over
`tau_versions` and `shape` on a grid (alpha_inf >= 0), one point per age (the median over a run's epochs). The chain then also predicts draft tokens verified per forward (the cost side)
and the acceptance rate; the calibration file lists them next to the measured ones (i.i.d. acceptance
drafts longer than the engines, whose drafts also stop where the history ends, so the modelled
verification cost is on the high side). Points: `histospec_benchmark.json` (history from the same policy: age 0) and the
`spec/*` counters of run dirs' metrics.jsonl, per epoch after the first, at age = policy versions per epoch.

Left out: sampled (rather than expected) accept sequences, drafts stopping early at low branch confidence
(absorbed into the fitted alpha), draft trees, and any dependence of acceptance on the position within a
response. The calibration comes from a tiny model on CPU; how many versions a 32B policy needs to drift as
far is an assumption the scenario YAMLs state (`tau_versions`).
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from megatron_sortedrl.schema import help_field
from megatron_sortedrl.errors import ConfigError, UserError

SPEC_SUFFIX = "+histospec"


@dataclass
class SpeculationConfig:
    """Defaults: the fit in docs/benchmarks/histospec_sim_calibration.json (tiny model on CPU, `calibrate`)."""

    alpha_0: float = help_field("Per-draft-token acceptance with history from the current policy (age 0).", 0.8978, min=0, lt=1)
    alpha_inf: float = help_field("Per-draft-token acceptance once the policy has moved far from the history.", 0.3107, min=0, lt=1)
    tau_versions: float = help_field("Policy versions over which acceptance decays from alpha_0 towards alpha_inf.", 17.0, gt=0)
    shape: float = help_field("Exponent p of the decay exp(-(age / tau)^p): 1 exponential, 2 Gaussian (slow, then fast).", 1.5, gt=0)
    jitter: float = help_field("Per-request relative spread of acceptance (uniform +-jitter).", 0.1, min=0, max=1)
    alpha_cap: float = help_field("Highest per-request acceptance (also what the physical limit assumes).", 0.97, min=0, lt=1)
    min_draft_tokens: int = help_field("Adaptive draft length: start and floor (speculative.min_draft_tokens).", 2, min=1)  # type: ignore[assignment]
    max_draft_tokens: int = help_field("Adaptive draft length cap (speculative.max_draft_tokens).", 16, min=1)  # type: ignore[assignment]
    drafter_s_per_step: float = help_field("Drafter time per engine step with drafts, in seconds.", 0.0003, min=0)
    sibling_drafts: bool = help_field("As the engines' `speculative.sibling_drafts`: a finished response reaches the "
                                      "drafters at once, and its siblings still running re-resolve their rate from it.", True)

    def __post_init__(self) -> None:
        for key in ("alpha_0", "alpha_inf", "alpha_cap"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"speculation.{key}", getattr(self, key), "a float in [0, 1)")
        if self.tau_versions <= 0 or self.shape <= 0:
            raise ConfigError("speculation.tau_versions", (self.tau_versions, self.shape), "tau_versions and shape > 0")
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError("speculation.jitter", self.jitter, "a float in [0, 1]")
        if not 1 <= self.min_draft_tokens <= self.max_draft_tokens:
            raise ConfigError("speculation.max_draft_tokens", (self.min_draft_tokens, self.max_draft_tokens),
                              "1 <= min_draft_tokens <= max_draft_tokens")
        if self.drafter_s_per_step < 0:
            raise ConfigError("speculation.drafter_s_per_step", self.drafter_s_per_step, "a number >= 0")

    def alpha(self, age_versions: float) -> float:
        """Mean per-token acceptance for history `age_versions` policy versions old."""
        w = math.exp(-((max(0.0, age_versions) / self.tau_versions) ** self.shape))
        return min(self.alpha_cap, self.alpha_inf + (self.alpha_0 - self.alpha_inf) * w)


def split_policy(name: str) -> tuple[str, bool]:
    """'twotier+histospec' -> ('twotier', True); 'twotier' -> ('twotier', False)."""
    if name.endswith(SPEC_SUFFIX):
        return name[: -len(SPEC_SUFFIX)], True
    return name, False


def emitted(alpha: float, k: int) -> float:
    """Expected tokens one target forward emits with a k-token draft: accepted prefix + 1."""
    if k <= 0 or alpha <= 0.0:
        return 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@lru_cache(maxsize=4096)
def chain(alpha: float, kmin: int, kmax: int) -> tuple[float, float, float]:
    """Stationary (tokens per forward, draft tokens per forward, acceptance rate) of the adaptive length rule."""
    if alpha <= 0.0:
        # Nothing is ever accepted: the rule sits at its floor, every forward emits one token.
        return 1.0, float(kmin), 0.0
    states, todo = [], [kmin]
    while todo:  # lengths the rule can reach from its start (the engines' AdaptiveDraftLength)
        k = todo.pop()
        if k not in states:
            states.append(k)
            todo += [min(k * 2, kmax), max(k // 2, kmin)]
    states.sort()
    idx = {k: i for i, k in enumerate(states)}
    pi = [1.0 / len(states)] * len(states)
    for _ in range(2000):  # a handful of states: power iteration converges fast
        nxt = [0.0] * len(states)
        for i, k in enumerate(states):
            full = alpha**k
            nxt[idx[min(k * 2, kmax)]] += pi[i] * full
            nxt[idx[max(k // 2, kmin)]] += pi[i] * (1.0 - full)
        done = max(abs(a - b) for a, b in zip(nxt, pi)) < 1e-13
        pi = nxt
        if done:
            break
    rate = sum(p * emitted(alpha, k) for p, k in zip(pi, states))
    drafted = sum(p * k for p, k in zip(pi, states))
    return rate, drafted, (rate - 1.0) / drafted


def alpha_for_rate(tokens_per_forward: float, kmin: int, kmax: int) -> float:
    """Per-token alpha whose adaptive chain emits this many tokens per target forward."""
    lo, hi = 0.0, 0.9999
    for _ in range(60):
        mid = (lo + hi) / 2
        if chain(round(mid, 6), kmin, kmax)[0] < tokens_per_forward:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class HistoSpecSim:
    """Per-prompt history ages and per-request speculation rates for one simulation."""

    def __init__(self, cfg: SpeculationConfig, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed
        self.published: dict[str, tuple[int, int]] = {}  # prompt -> (epoch, version) the drafters hold
        self.pending: dict[str, tuple[int, int]] = {}  # recorded this round, shipped at the next
        self.drafting_requests = self.requests = 0
        self.rate_sum = 0.0  # over drafting requests

    def record(self, prompt_id: str, epoch: int, version: int) -> None:
        for table in (self.pending,):
            old = table.get(prompt_id) or self.published.get(prompt_id)
            if old is not None and epoch < old[0]:
                return  # an older epoch never overwrites fresher history
            if old is None or epoch > old[0] or version > old[1]:
                table[prompt_id] = (epoch, version)

    def publish(self) -> None:
        """Round boundary: what finished in the last round reaches the drafters."""
        self.published.update(self.pending)
        self.pending = {}

    def ship_sibling(self, prompt_id: str, epoch: int, version: int) -> bool:
        """`sibling_drafts`: a finished response reaches the drafters at once (the driver ships it during the
        round). True when it makes the prompt's history newer, so its running siblings draft better from now."""
        if not self.cfg.sibling_drafts:
            return False
        old = self.published.get(prompt_id)
        if old is not None and (epoch, version) <= old:
            return False
        self.published[prompt_id] = (epoch, version)
        return True

    def rerate(self, prompt_id: str, sample_id: str, attempt: int, version: int) -> tuple[float, float]:
        """(rate, positions) of a running request once its prompt's history changed (not counted as a request)."""
        self.requests -= 1
        before = self.drafting_requests, self.rate_sum
        out = self.rate(prompt_id, sample_id, attempt, version)
        self.drafting_requests, self.rate_sum = before  # a request is counted once, at submission
        return out

    def rate(self, prompt_id: str, sample_id: str, attempt: int, version: int) -> tuple[float, float]:
        """(tokens per forward, positions verified per forward) for a request submitted at `version`."""
        self.requests += 1
        hist = self.published.get(prompt_id)
        if hist is None:
            return 1, 1
        c = self.cfg
        u = random.Random(f"{self.seed}:spec:{sample_id}:{attempt}").uniform(-1.0, 1.0)
        alpha = min(c.alpha_cap, max(0.0, c.alpha(version - hist[1]) * (1.0 + c.jitter * u)))
        if alpha <= 0.0:
            return 1, 1
        self.drafting_requests += 1
        rate, drafted, _ = chain(round(alpha, 3), c.min_draft_tokens, c.max_draft_tokens)
        self.rate_sum += rate
        return rate, 1.0 + drafted

    def stats(self) -> dict[str, float]:
        return {"requests": self.requests, "drafting_share": self.drafting_requests / max(1, self.requests),
                "mean_tokens_per_forward_drafting": self.rate_sum / max(1, self.drafting_requests)}

    def step_s(self, model: Any, tp: int, batch: int, positions: float, context: float) -> float:
        """One engine step verifying `positions` positions over `batch` sequences (drafter time when drafting)."""
        extra = self.cfg.drafter_s_per_step if positions > batch else 0.0
        return model.verify_step_s(tp, positions, context) + extra


def best_rate(cfg: SpeculationConfig | None) -> list[tuple[int, float]]:
    """(draft length k, tokens per forward at the best acceptance) for k = 0..max: the limit's candidates."""
    if cfg is None:
        return [(0, 1.0)]
    return [(k, emitted(cfg.alpha_cap, k)) for k in range(0, cfg.max_draft_tokens + 1)]


# --------------------------------------------------------------------------------------------- calibration

def points_from_benchmark(path: str | Path) -> list[dict[str, Any]]:
    """The HistoSpec row of histospec_benchmark.json: history from the policy that generates (age 0)."""
    data = json.loads(Path(path).read_text())
    row = next((m for m in data["methods"] if m["method"] == "histospec"), None)
    if row is None:
        raise UserError(f"{path}: no 'histospec' method row; run benchmarks/histospec_benchmark.py")
    runs = row.get("runs") or []
    verified = sum(r.get("verified_draft_tokens", 0.0) for r in runs)
    forwards = sum(r.get("forwards", 0.0) for r in runs)
    return [{"source": str(path), "age_versions": 0.0, "acceptance": row["acceptance_rate"],
             "tokens_per_forward": row["tokens_per_forward"],
             "draft_tokens_per_forward": verified / forwards if forwards else None}]


def points_from_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per epoch after the first: acceptance from the cumulative spec/* counters of metrics.jsonl.

    Age is the policy versions between a prompt's epoch e-1 and epoch e runs: updates per epoch, i.e.
    num_train_prompts / fresh prompts per round (every round loads the same number in a steady run).
    """
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    metrics, cfg_path = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not metrics.is_file() or not cfg_path.is_file():
        raise UserError(f"{run_dir}: needs metrics.jsonl and config.yaml (a finished train run dir)")
    n_prompts = int(OmegaConf.load(cfg_path).data.num_train_prompts)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "spec/tokens" in r]
    if len(rows) < 2:
        return []
    fresh = [r.get("scheduler/fresh", 0) for r in rows]
    per_round = sorted(fresh)[len(fresh) // 2] or 1
    age = n_prompts / per_round
    loaded, prev, agg = 0, None, {}
    for r, f in zip(rows, fresh):
        epoch = int(loaded // n_prompts)
        loaded += f
        if prev is not None and epoch >= 1:
            a = agg.setdefault(epoch, [0.0, 0.0, 0.0])
            for i, key in enumerate(("spec/tokens", "spec/draft_tokens", "spec/accepted_tokens")):
                a[i] += r[key] - prev[key]
        prev = r
    out = []
    for epoch, (tokens, drafts, accepted) in sorted(agg.items()):
        if drafts > 0:
            forwards = max(1.0, tokens - accepted)
            out.append({"source": f"{run_dir}#epoch{epoch}", "age_versions": age, "acceptance": accepted / drafts,
                        "tokens_per_forward": tokens / forwards, "draft_tokens_per_forward": drafts / forwards})
    return out


def calibrate(points: list[dict[str, Any]], kmin: int = 2, kmax: int = 16) -> dict[str, Any]:
    """Fits alpha_0, alpha_inf, tau_versions to measured (age, acceptance) points (see the module docstring)."""
    if not points:
        raise UserError("speculation calibration: no measured points")
    xs = [(p["age_versions"], alpha_for_rate(p["tokens_per_forward"], kmin, kmax)) for p in points]
    ages = sorted({a for a, _ in xs})
    means = []
    for a in ages:  # median per age: a run's epochs share one age, its first epoch may still lack history
        vals = sorted(al for b, al in xs if b == a)
        means.append((a, vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2))
    best: tuple[float, float, float, float, float] | None = None
    for shape in (1.0, 1.5, 2.0, 3.0):
        for i in range(1, 400):
            tau = 0.25 * i
            ws = [math.exp(-((a / tau) ** shape)) for a, _ in means]
            # For fixed tau and shape the curve is linear in (alpha_inf, alpha_0 - alpha_inf): least squares,
            # with alpha_inf held at 0 when the free fit would make it negative.
            n = len(means)
            mw, my = sum(ws) / n, sum(m for _, m in means) / n
            var = sum((w - mw) ** 2 for w in ws)
            slope = sum((w - mw) * (m - my) for w, (_, m) in zip(ws, means)) / var if var > 0 else 0.0
            ainf = my - slope * mw
            if ainf < 0 or var == 0:
                ainf = 0.0 if var > 0 else my
                slope = sum(w * m for w, (_, m) in zip(ws, means)) / sum(w * w for w in ws) if var > 0 else 0.0
            a0 = ainf + slope
            err = sum((ainf + (a0 - ainf) * w - m) ** 2 for w, (_, m) in zip(ws, means))
            if best is None or err < best[0] - 1e-15:
                best = (err, tau, a0, ainf, shape)
    assert best is not None
    err, tau, a0, ainf, shape = best
    fitted = {"alpha_0": round(min(0.99, max(0.0, a0)), 4), "alpha_inf": round(min(0.99, max(0.0, ainf)), 4),
              "tau_versions": tau, "shape": shape}
    cfg = SpeculationConfig(**fitted, min_draft_tokens=kmin, max_draft_tokens=kmax)
    check = []
    for p, (age, alpha) in zip(points, xs):
        rate, drafted, acc = chain(round(cfg.alpha(age), 4), kmin, kmax)
        check.append({**p, "alpha_per_token": round(alpha, 4), "model_alpha": round(cfg.alpha(age), 4),
                      "model_acceptance": round(acc, 4), "model_tokens_per_forward": round(rate, 3),
                      "model_draft_tokens_per_forward": round(drafted, 3)})
    return {"fitted": fitted, "residual": err, "points": check, "definition": (
        "alpha(a) = alpha_inf + (alpha_0 - alpha_inf) * exp(-(a / tau_versions)^shape); alpha is per draft token, "
        "inverted from measured tokens per target forward through the adaptive draft-length chain")}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1])
        return 2
    points: list[dict[str, Any]] = []
    for src in argv:
        points += points_from_benchmark(src) if src.endswith(".json") else points_from_run(src)
    result = calibrate(points)
    out = Path("docs/benchmarks/histospec_sim_calibration.json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["fitted"]))
    for p in result["points"]:
        print(f"  age {p['age_versions']:5.1f}  measured tok/fwd {p['tokens_per_forward']:.2f} drafts/fwd "
              f"{p['draft_tokens_per_forward'] or 0:.2f} acceptance {p['acceptance']:.3f} | model tok/fwd "
              f"{p['model_tokens_per_forward']:.2f} drafts/fwd {p['model_draft_tokens_per_forward']:.2f} "
              f"acceptance {p['model_acceptance']:.3f}  {p['source']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["SpeculationConfig", "HistoSpecSim", "split_policy", "chain", "emitted", "calibrate", "asdict"]
