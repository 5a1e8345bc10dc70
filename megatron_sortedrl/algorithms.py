"""RL math as pure torch functions: advantages, PPO-clip with clip-higher, aggregation, KL, entropy, TIS.

    from megatron_sortedrl import algorithms as A
    adv = A.compute_advantages(rewards, group_ids, "grpo")                  # one scalar per sample
    out = A.policy_loss(logp, behaviour_logp, adv_tok, mask, clip_low=0.2, clip_high=0.28)
    pytest tests/test_algorithms.py

Shapes: per-sample tensors are [B]; per-token tensors are [B, T] with `mask` 1.0 on response tokens that
count and 0.0 elsewhere (padding, prompt). Log-probs are natural logs.

Conventions (each matches the reference formula in tests/test_algorithms.py):

* GRPO: `A_i = (r_i - mean_g) / (std_g + eps)` within the prompt's group (std optional; population std).
* RLOO: `A_i = r_i - mean_{j != i, j in g} r_j`.
* Reinforce++: the reward, whitened over all response tokens of the batch (token-weighted mean/std).
* Reinforce++-baseline: the group mean is subtracted first, then the same whitening.
* PPO-clip with clip-higher: `ratio = exp(clamp(logp - logp_old, -k, k))` (`log_ratio_clamp` k, verl's 20;
  0: no clamp), `loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`.
* Clip statistics per trained token: `clip_frac` (the clipped branch active), split into `clip_frac_high`
  (ratio above 1 + clip_high, A > 0) and `clip_frac_low` (ratio below 1 - clip_low, A < 0); `ppo_kl` =
  `logp_old - logp` (verl's k1 estimate of KL(old || current)). All are 0 on the first optimizer step of a
  harvest (the proximal policy is the current one) and grow over its mini-batches (megatron_sortedrl/minibatch.py).
* Dual-clip (Ye et al. 2020, verl's `clip_ratio_c`): for A < 0 the loss is also capped at `-c * A`, so a token
  whose ratio has grown far past the clip range (a stale or mismatched sample) cannot push the loss without
  bound; A >= 0 is unchanged (there PPO-clip already bounds it). `c` > 1; 0 turns it off.
* Truncated importance sampling (rollout/trainer mismatch): `w_t = min(exp(logp_old - logp_rollout), cap)`,
  detached, multiplies the per-token policy loss. `logp_old` is the trainer's proximal policy; for tokens
  of a partial rollout sampled by older versions `logp_rollout` is the per-token behaviour log-prob of the
  version that sampled it, so the same weight also corrects staleness.
* Trainer-rollout mismatch (logged for every model whenever the engines' log-probs are known), with
  `log rho = logp_old - logp_rollout` per trained token: `mismatch/logp_abs_diff` = |log rho|,
  `mismatch/k3_kl` = `rho - 1 - log rho` (k3 estimate of KL(engine || trainer) on the engine's own samples),
  `mismatch/ratio_out_of_band` = 1 when rho leaves [0.5, 2].
* Corrections beside TIS (each off at 0; the weight multiplies the per-token policy loss, detached; a masked
  token keeps its place in the aggregation's denominator, as a zero-weight token does under TIS):
  - MIS (`mis_high`, `mis_low`): `w_t = rho_t` inside [mis_low, mis_high], 0 outside: masked instead of
    truncated; it replaces TIS's `min(rho, cap)`.
  - IcePop (`icepop_beta`): tokens with rho outside [1/beta, beta] are masked (w_t = 0); the others keep their
    importance weight (TIS or MIS), so TIS with cap = beta gives IcePop's `rho * 1[1/beta <= rho <= beta]`.
  - Sequence mask (`seq_geo_band`, `seq_token_band`): a whole sequence gets w = 0 when its geometric-mean
    ratio `exp(mean_t log rho_t)` leaves [1/b, b], or when any of its tokens' rho leaves [1/b', b']
    (max deviation `max_t |log rho_t| > log b'`); the means and maxima run over trained tokens only.
* KL to the reference: the k3 estimator `exp(ref - logp) - (ref - logp) - 1` (non-negative, unbiased).
* DAPO soft overlong penalty (`overlong_penalty`): 0 up to `max_len - buffer` tokens, then
  `((max_len - buffer) - L) / buffer * factor`, linear down to `-factor` at `max_len`, and `-factor` beyond.
* Aggregation: `token` = sum over all tokens / number of tokens; `sequence` = mean over sequences of the
  per-sequence token mean. `token_weights` gives the weights so a sharded batch (micro-batches, data
  parallel ranks) can sum its parts against global counts.

Deliberately left out: value functions / GAE (no critic in this project) and sequence-level importance
ratios (GSPO); the sequence mask only masks, it does not reweight by the sequence ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADVANTAGES = ("grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo")
# Subtract a per-prompt statistic: with one sample per prompt the advantage is 0 (or undefined).
GROUP_BASELINE = ("grpo", "reinforce_pp_baseline", "rloo")
# Normalised over the whole update batch: a prompt group's advantages are known only with the whole batch.
BATCH_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")


def _group_index(group_ids: Sequence) -> tuple[torch.Tensor, int]:
    ids: dict = {}
    idx = torch.tensor([ids.setdefault(g, len(ids)) for g in group_ids], dtype=torch.long)
    return idx, len(ids)


def _group_stats(rewards: torch.Tensor, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # math.fsum is exact, so a group's statistics do not depend on the order of its samples or on what else is in
    # the batch: a prompt group streamed on its own gets bit-identical advantages to the same group in the batch.
    members: list[list[float]] = [[] for _ in range(n)]
    for v, g in zip(rewards.tolist(), idx.tolist()):
        members[g].append(v)
    means = [math.fsum(m) / len(m) for m in members]
    var = [math.fsum((x - mu) ** 2 for x in m) / len(m) for m, mu in zip(members, means)]
    count = torch.tensor([float(len(m)) for m in members], dtype=rewards.dtype)
    return count, torch.tensor(means, dtype=rewards.dtype), torch.tensor(var, dtype=rewards.dtype).sqrt()


def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    idx, n = _group_index(group_ids)
    _, mean, std = _group_stats(rewards, idx, n)
    adv = rewards - mean[idx]
    return adv / (std[idx] + eps) if normalize_std else adv


def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence) -> torch.Tensor:
    idx, n = _group_index(group_ids)
    count, mean, _ = _group_stats(rewards, idx, n)
    c = count[idx]
    if bool((c < 2).any()):
        raise ValueError("RLOO needs at least 2 samples per group")
    loo_mean = (mean[idx] * c - rewards) / (c - 1)
    return rewards - loo_mean


def _whiten_tokens(values: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    vals, w = values.tolist(), lengths.to(values.dtype).tolist()
    total = math.fsum(w)
    mean = math.fsum(v * n for v, n in zip(vals, w)) / total
    var = math.fsum((v - mean) ** 2 * n for v, n in zip(vals, w)) / total
    return (values - mean) / (math.sqrt(var) + eps)


def reinforce_pp_advantages(rewards: torch.Tensor, lengths: torch.Tensor, group_ids: Sequence | None = None,
                            *, baseline: bool = False) -> torch.Tensor:
    """Reinforce++ (baseline=False) or Reinforce++-baseline (group mean subtracted first)."""
    values = rewards
    if baseline:
        if group_ids is None:
            raise ValueError("reinforce_pp_baseline needs group ids")
        idx, n = _group_index(group_ids)
        _, mean, _ = _group_stats(rewards, idx, n)
        values = rewards - mean[idx]
    return _whiten_tokens(values, lengths.clamp(min=1))


def compute_advantages(rewards: torch.Tensor, group_ids: Sequence, method: str, *,
                       lengths: torch.Tensor | None = None, normalize_std: bool = True) -> torch.Tensor:
    """One scalar advantage per sample (broadcast over its response tokens by the caller)."""
    rewards = rewards.to(torch.float64)
    if method == "grpo":
        out = grpo_advantages(rewards, group_ids, normalize_std=normalize_std)
    elif method == "rloo":
        out = rloo_advantages(rewards, group_ids)
    elif method in ("reinforce_pp", "reinforce_pp_baseline"):
        if lengths is None:
            raise ValueError(f"{method} needs response lengths")
        out = reinforce_pp_advantages(rewards, lengths, group_ids, baseline=method == "reinforce_pp_baseline")
    else:
        raise ValueError(f"unknown advantage estimator {method!r}; expected one of {ADVANTAGES}")
    return out.to(torch.float32)


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the task reward."""
    if buffer <= 0:
        return 0.0
    start = max_len - buffer
    if length <= start:
        return 0.0
    if length > max_len:
        return -factor
    return (start - length) / buffer * factor


# ------------------------------------------------------------------------------------------- losses


def token_weights(mask: torch.Tensor, mode: str, num_tokens: float | None = None,
                  num_sequences: float | None = None) -> torch.Tensor:
    """Weights w with loss = sum(w * per_token_loss); counts default to this batch's, or pass global ones."""
    mask = mask if mask.is_floating_point() else mask.to(torch.float32)
    if mode == "token":
        n = float(mask.sum()) if num_tokens is None else float(num_tokens)
        return mask / max(n, 1.0)
    if mode == "sequence":
        s = float(mask.shape[0]) if num_sequences is None else float(num_sequences)
        per_seq = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / per_seq / max(s, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected token or sequence")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    return (per_token * token_weights(mask.to(per_token.dtype), mode)).sum()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights trainer/rollout; cap <= 0 disables (all ones)."""
    if cap <= 0:
        return torch.ones_like(logp_old)
    return torch.exp(logp_old - logp_rollout).clamp(max=cap).detach()


MISMATCH_BAND = (0.5, 2.0)  # importance ratios outside it count in `mismatch/ratio_out_of_band`
_LOG_RHO_CLAMP = 20.0  # exp() of a log-ratio beyond this overflows float32 arithmetic downstream (verl's clamp)


def mismatch_terms(logp_old: torch.Tensor, logp_rollout: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token trainer-rollout mismatch (detached; average over the trained tokens to log it)."""
    log_rho = (logp_old - logp_rollout).detach()
    lo, hi = math.log(MISMATCH_BAND[0]), math.log(MISMATCH_BAND[1])
    d = log_rho.clamp(max=_LOG_RHO_CLAMP)  # a finite KL even for a wild token (exp(20) still fits)
    return {"mismatch/logp_abs_diff": log_rho.abs(),
            "mismatch/k3_kl": torch.exp(d) - d - 1.0,  # = kl_k3(logp_rollout, logp_old), clamped
            "mismatch/ratio_out_of_band": ((log_rho < lo) | (log_rho > hi)).to(logp_old.dtype)}


def _outside(log_rho: torch.Tensor, band: float) -> torch.Tensor:
    """1 where rho leaves [1/band, band] (band > 1), as a bool tensor."""
    return log_rho.abs() > math.log(band)


def rollout_correction(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor | None = None, *,
                       tis_cap: float = 0.0, mis_low: float = 0.0, mis_high: float = 0.0, icepop_beta: float = 0.0,
                       seq_geo_band: float = 0.0, seq_token_band: float = 0.0
                       ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The detached per-token weight of the trainer/rollout correction ([B, T], rows are sequences) and its
    per-token indicator terms; weight None when every correction is off. See the module docstring."""
    log_rho = (logp_old - logp_rollout).detach()
    mask = torch.ones_like(log_rho) if mask is None else mask.to(log_rho.dtype)
    terms: dict[str, torch.Tensor] = {}
    w = None
    if mis_high > 0:
        rho = torch.exp(log_rho.clamp(-_LOG_RHO_CLAMP, _LOG_RHO_CLAMP))
        out = (rho < mis_low) | (rho > mis_high)
        w = torch.where(out, torch.zeros_like(rho), rho)
        terms["correction/mis_masked"] = out.to(log_rho.dtype)
    elif tis_cap > 0:
        w = tis_weights(logp_old.detach(), logp_rollout, tis_cap)
        terms["tis_weight"] = w
    if icepop_beta > 0:
        out = _outside(log_rho, icepop_beta)
        w = (torch.ones_like(log_rho) if w is None else w) * (~out).to(log_rho.dtype)
        terms["correction/icepop_masked"] = out.to(log_rho.dtype)
    if seq_geo_band > 0 or seq_token_band > 0:
        drop = torch.zeros(log_rho.shape[:-1], dtype=torch.bool, device=log_rho.device)
        if seq_geo_band > 0:
            geo = (log_rho * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # log of the geometric-mean ratio
            drop |= geo.abs() > math.log(seq_geo_band)
        if seq_token_band > 0:
            drop |= ((log_rho.abs() * mask).amax(-1) > math.log(seq_token_band))
        keep = (~drop).to(log_rho.dtype).unsqueeze(-1).expand_as(log_rho)
        w = (torch.ones_like(log_rho) if w is None else w) * keep
        terms["correction/seq_masked"] = 1.0 - keep
    return w, terms


def log_ratio(logp: torch.Tensor, logp_old: torch.Tensor, clamp: float = 0.0) -> torch.Tensor:
    """`logp - logp_old`, clamped to [-clamp, clamp] when clamp > 0 (verl: 20) so exp() cannot overflow."""
    d = logp - logp_old
    return d.clamp(-clamp, clamp) if clamp > 0 else d


def _ppo_clip(logp, logp_old, advantages, clip_low, clip_high, clip_ratio_c, log_ratio_clamp):
    ratio = torch.exp(log_ratio(logp, logp_old, log_ratio_clamp))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    lower = torch.zeros_like(loss)
    if clip_ratio_c > 0:
        cap = -clip_ratio_c * advantages
        negative = advantages < 0
        lower = (negative & (loss > cap)).to(logp.dtype)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, (clipped < unclipped).to(logp.dtype), lower, ratio


def ppo_clip_per_token(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, *,
                       clip_low: float, clip_high: float, clip_ratio_c: float = 0.0,
                       log_ratio_clamp: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss (dual-clip when clip_ratio_c > 0) and a 0/1 tensor marking tokens where the
    clipped branch was active."""
    loss, clipped, _, _ = _ppo_clip(logp, logp_old, advantages, clip_low, clip_high, clip_ratio_c, log_ratio_clamp)
    return loss, clipped


def policy_loss_per_token(logp: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor | None,
                          advantages: torch.Tensor, *, clip_low: float, clip_high: float, tis_cap: float = 0.0,
                          ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                          entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                          clip_ratio_c: float = 0.0, log_ratio_clamp: float = 0.0,
                          mask: torch.Tensor | None = None, mis_low: float = 0.0, mis_high: float = 0.0,
                          icepop_beta: float = 0.0, seq_geo_band: float = 0.0, seq_token_band: float = 0.0
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-token objective (before aggregation) and per-token terms for logging. With `logp_rollout`
    the mismatch terms are always there and the corrections (TIS, MIS, IcePop, sequence mask) apply as set;
    `mask` (trained tokens) only matters to the sequence mask."""
    pg, clipped, lower, ratio = _ppo_clip(logp, logp_old, advantages, clip_low, clip_high, clip_ratio_c,
                                          log_ratio_clamp)
    r = ratio.detach()
    terms = {"pg_loss": pg, "clip_frac": clipped, "ratio": r,
             # which side of the band held a token (clip_frac is their sum), and the k1 estimate of
             # KL(old || current) over the trained tokens (verl's ppo_kl): all 0 at the first step on a harvest
             "clip_frac_high": clipped * (r > 1.0).to(logp.dtype), "clip_frac_low": clipped * (r < 1.0).to(logp.dtype),
             "ppo_kl": (logp_old - logp).detach()}
    if clip_ratio_c > 0:
        terms["clip_frac_lower"] = lower  # verl's pg_clipfrac_lower: tokens held at the dual-clip bound
    if logp_rollout is not None:
        terms.update(mismatch_terms(logp_old, logp_rollout))
        w, corr = rollout_correction(logp_old, logp_rollout, mask, tis_cap=tis_cap, mis_low=mis_low,
                                     mis_high=mis_high, icepop_beta=icepop_beta, seq_geo_band=seq_geo_band,
                                     seq_token_band=seq_token_band)
        terms["rollout_kl"] = (logp_rollout - logp_old).detach()  # k1 estimate of KL(rollout || trainer)
        if w is not None:
            pg = pg * w
            terms.update(corr)
    loss = pg
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp)
        loss = loss + kl_coef * kl
        terms["kl"] = kl.detach()
    if entropy is not None:
        if entropy_coef > 0:
            loss = loss - entropy_coef * entropy
        terms["entropy"] = entropy.detach()
    return loss, terms


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float, clip_high: float, aggregation: str = "token",
                logp_rollout: torch.Tensor | None = None, tis_cap: float = 0.0,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                clip_ratio_c: float = 0.0, log_ratio_clamp: float = 0.0, **corrections: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregated loss of a whole batch and token-mean metrics (convenience over the per-token form);
    `corrections`: mis_low, mis_high, icepop_beta, seq_geo_band, seq_token_band."""
    per_token, terms = policy_loss_per_token(
        logp, logp_old, logp_rollout, advantages, clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
        ref_logp=ref_logp, kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef,
        clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp, mask=mask, **corrections)
    n = mask.sum().clamp(min=1)
    metrics = {k: float((v * mask).sum() / n) for k, v in terms.items()}
    return aggregate(per_token, mask, aggregation), metrics
