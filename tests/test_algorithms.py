"""Advantage estimators and the PPO-clip loss against naive, loop-based reference formulas.

    pytest tests/test_algorithms.py -q        # CPU, a few seconds
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_sortedrl import algorithms as A


def _batch(seed: int, n_groups: int = 4, group: int = 4):
    rng = random.Random(seed)
    rewards, ids, lengths = [], [], []
    for g in range(n_groups):
        for _ in range(group):
            rewards.append(rng.choice([0.0, 1.0, 0.5, rng.random()]))
            ids.append(f"p{g}")
            lengths.append(rng.randint(1, 20))
    return rewards, ids, lengths


def _naive_grpo(rewards, ids, normalize=True, eps=1e-6):
    out = []
    for r, g in zip(rewards, ids):
        grp = [x for x, h in zip(rewards, ids) if h == g]
        mean = sum(grp) / len(grp)
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / len(grp))
        out.append((r - mean) / (std + eps) if normalize else r - mean)
    return out


def _naive_rloo(rewards, ids):
    out = []
    for i, (r, g) in enumerate(zip(rewards, ids)):
        others = [x for j, (x, h) in enumerate(zip(rewards, ids)) if h == g and j != i]
        out.append(r - sum(others) / len(others))
    return out


def _naive_whiten_tokens(values, lengths, eps=1e-6):
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / len(tokens))
    return [(v - mean) / (std + eps) for v in values]


@pytest.mark.parametrize("seed", range(5))
def test_advantages_match_reference(seed):
    rewards, ids, lengths = _batch(seed)
    r, L = torch.tensor(rewards), torch.tensor(lengths)
    checks = {
        "grpo": _naive_grpo(rewards, ids),
        "rloo": _naive_rloo(rewards, ids),
        "reinforce_pp": _naive_whiten_tokens(rewards, lengths),
        "reinforce_pp_baseline": _naive_whiten_tokens(_naive_grpo(rewards, ids, normalize=False), lengths),
    }
    for method, ref in checks.items():
        got = A.compute_advantages(r, ids, method, lengths=L).tolist()
        assert got == pytest.approx(ref, abs=1e-5), method
    got = A.compute_advantages(r, ids, "grpo", normalize_std=False).tolist()
    assert got == pytest.approx(_naive_grpo(rewards, ids, False), abs=1e-6)


def test_grpo_group_with_equal_rewards_has_zero_advantage():
    adv = A.compute_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), ["a", "a", "b", "b"], "grpo")
    assert adv[:2].abs().max() < 1e-6
    assert adv[2] < 0 < adv[3]


def test_rloo_needs_two_samples_and_unknown_method_fails():
    with pytest.raises(ValueError):
        A.compute_advantages(torch.tensor([1.0, 0.0]), ["a", "b"], "rloo")
    with pytest.raises(ValueError, match="unknown advantage"):
        A.compute_advantages(torch.tensor([1.0]), ["a"], "ppo")


def _naive_ppo(logp, old, adv, mask, lo, hi, mode, rollout=None, cap=0.0, ref=None, kl_coef=0.0):
    B, T = len(logp), len(logp[0])
    per = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            ratio = math.exp(logp[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - lo), 1 + hi)
            loss = -min(ratio * adv[b][t], clipped * adv[b][t])
            if rollout is not None and cap > 0:
                loss *= min(math.exp(old[b][t] - rollout[b][t]), cap)
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                loss += kl_coef * (math.exp(d) - d - 1)
            per[b][t] = loss
    if mode == "token":
        n = sum(sum(row) for row in mask)
        return sum(per[b][t] * mask[b][t] for b in range(B) for t in range(T)) / n
    seq = []
    for b in range(B):
        n = sum(mask[b])
        seq.append(sum(per[b][t] * mask[b][t] for t in range(T)) / max(n, 1))
    return sum(seq) / B


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(4))
def test_ppo_clip_loss_matches_reference(mode, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # ratios well outside the clip range
    rollout = old + 0.3 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0, 3] = 0.0
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[1] = 0.0  # a fully masked row
    mask[2, 0] = 1.0
    got, metrics = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation=mode,
                                 logp_rollout=rollout, tis_cap=1.5, ref_logp=ref, kl_coef=0.05)
    want = _naive_ppo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, mode,
                      rollout.tolist(), 1.5, ref.tolist(), 0.05)
    assert float(got) == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert 0.0 < metrics["clip_frac"] < 1.0
    assert metrics["tis_weight"] <= 1.5 + 1e-12


def test_clip_boundaries_are_asymmetric_and_gradients_stop_outside():
    adv_pos, adv_neg = torch.tensor([1.0]), torch.tensor([-1.0])
    old = torch.zeros(1)
    for ratio, adv, clipped in [(1.27, adv_pos, False), (1.29, adv_pos, True), (0.81, adv_neg, False),
                                (0.79, adv_neg, True), (1.5, adv_neg, False), (0.5, adv_pos, False)]:
        logp = torch.tensor([math.log(ratio)], requires_grad=True)
        loss, flag = A.ppo_clip_per_token(logp, old, adv, clip_low=0.2, clip_high=0.28)
        loss.sum().backward()
        assert bool(flag.item()) == clipped, (ratio, float(adv))
        # clipped branch active => no gradient; otherwise d(-ratio*A)/dlogp = -ratio*A
        want = 0.0 if clipped else -ratio * float(adv)
        assert float(logp.grad) == pytest.approx(want, rel=1e-6)
        if clipped:
            bound = 1.28 if float(adv) > 0 else 0.8
            assert float(loss.detach()) == pytest.approx(-bound * float(adv))


def test_masked_tokens_do_not_change_loss_or_receive_gradient():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 6, generator=g)).requires_grad_()
    old, adv = logp.detach() + 0.1, torch.ones(3, 6)
    mask = torch.ones(3, 6)
    mask[:, 4:] = 0
    loss, _ = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert logp.grad[:, 4:].abs().max() == 0
    logp2 = logp.detach().clone()
    logp2[:, 4:] = -50.0  # garbage in masked positions
    loss2, _ = A.policy_loss(logp2, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert float(loss2) == pytest.approx(float(loss))


def test_token_weights_sum_to_one_and_shard_consistently():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    for mode in ("token", "sequence"):
        assert float(A.token_weights(mask, mode).sum()) == pytest.approx(1.0)
        # two shards weighted with the global counts add up to the whole
        whole = A.token_weights(mask, mode)
        parts = torch.cat([A.token_weights(mask[:1], mode, 8, 3), A.token_weights(mask[1:], mode, 8, 3)])
        assert torch.allclose(whole, parts)


def test_tis_and_kl_basics():
    old, roll = torch.tensor([0.0, -1.0, -3.0]), torch.tensor([-2.0, -1.0, -1.0])
    w = A.tis_weights(old, roll, cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 1.0, math.exp(-2.0)]))
    assert torch.equal(A.tis_weights(old, roll, cap=0.0), torch.ones(3))
    assert A.kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    assert (A.kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_entropy_bonus_lowers_loss():
    logp, adv, mask = torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3)
    ent = torch.full((1, 3), 2.0)
    loss, m = A.policy_loss(logp, logp, adv, mask, clip_low=0.2, clip_high=0.2, entropy=ent, entropy_coef=0.1)
    assert float(loss) == pytest.approx(-0.2) and m["entropy"] == pytest.approx(2.0)


# ------------------------------------------------------------- verl's policy loss: dual-clip, log-ratio clamp


def _verl_compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                              clip_ratio_c, loss_agg_mode="token-mean"):
    """verl's `compute_policy_loss` (trainer/ppo/core_algos.py, vanilla PPO), written out from its documented
    definition: log-ratio clamped to [-20, 20]; PPO-clip; for negative advantages the dual-clip bound
    min(-A * c, .); token-mean or seq-mean-token-mean aggregation."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = (torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float() * response_mask).sum() \
        / response_mask.sum()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if loss_agg_mode == "token-mean":
        loss = (pg_losses * response_mask).sum() / response_mask.sum()
    else:  # seq-mean-token-mean
        loss = ((pg_losses * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)).mean()
    return loss, pg_clipfrac_lower


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(4))
def test_dual_clip_and_log_ratio_clamp_match_verl(mode, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 11
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # log-ratios across the whole range: inside the clip range, past the dual-clip constant (ratio > 3), and
    # past the clamp (|log ratio| > 20), in both signs
    logp0 = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5
    logp0[0, :3] = old[0, :3] + torch.tensor([25.0, -30.0, 21.0], dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[0], adv[1] = -1.3, 0.7  # the clamped tokens under a negative and (row 1) a positive advantage
    adv[1, :3] = 0.7
    logp0[1, :3] = old[1, :3] + torch.tensor([25.0, -30.0, 2.0], dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[0, :3] = mask[1, :3] = 1.0
    lo, hi, c = 0.2, 0.28, 3.0

    logp = logp0.clone().requires_grad_()
    got, metrics = A.policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, aggregation=mode,
                                 clip_ratio_c=c, log_ratio_clamp=20.0)
    got.backward()
    ref_logp = logp0.clone().requires_grad_()
    want, lower = _verl_compute_policy_loss(old, ref_logp, adv, mask, lo, hi, c,
                                            "token-mean" if mode == "token" else "seq-mean-token-mean")
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-12, abs=1e-12)
    assert torch.allclose(logp.grad, ref_logp.grad, rtol=1e-12, atol=1e-14)
    assert metrics["clip_frac_lower"] == pytest.approx(float(lower), abs=1e-12)
    assert metrics["clip_frac_lower"] > 0  # the dual-clip bound was active somewhere
    assert logp.grad[0, :2].abs().max() == 0 and logp.grad[1, :2].abs().max() == 0  # clamped: no gradient


def test_dual_clip_only_bounds_negative_advantages_and_zero_turns_it_off():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([5.0, 5.0, 0.5, 0.5]))  # ratios 5, 5, 0.5, 0.5
    adv = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    loss, _ = A.ppo_clip_per_token(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    # A < 0 at ratio 5: PPO-clip alone gives 5, dual-clip caps it at c = 3; A > 0: 1.28 (clip-higher bound)
    assert loss.tolist() == pytest.approx([3.0, -1.28, 0.8, -0.5])
    plain, _ = A.ppo_clip_per_token(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_ratio_c=0.0)
    assert plain.tolist() == pytest.approx([5.0, -1.28, 0.8, -0.5])
    big = torch.tensor([100.0])  # an overflowing log-ratio stays finite with the clamp
    assert math.isfinite(float(A.ppo_clip_per_token(big, torch.zeros(1), torch.ones(1), clip_low=0.2, clip_high=0.28,
                                                    log_ratio_clamp=20.0)[0]))


@pytest.mark.parametrize("seed", range(3))
def test_advantages_do_not_depend_on_batch_order(seed):
    """A prompt group gets bit-identical advantages alone, in any order, and inside any batch (what lets a streamed
    group be trained exactly as in the batch)."""
    rng = random.Random(seed)
    rewards, ids, _ = _batch(seed, n_groups=5, group=6)
    rewards = [r + rng.random() / 3 for r in rewards]  # fractional rewards: float sums depend on order
    perm = list(range(len(rewards)))
    rng.shuffle(perm)
    # float64 estimators (compute_advantages rounds them to float32, which hides most order effects)
    for name, fn in (("grpo", A.grpo_advantages), ("rloo", A.rloo_advantages)):
        def adv(idx):
            return fn(torch.tensor([rewards[i] for i in idx], dtype=torch.float64), [ids[i] for i in idx]).tolist()

        whole = adv(range(len(rewards)))
        shuffled = adv(perm)
        assert [shuffled[perm.index(i)] for i in range(len(rewards))] == whole, name
        group = [i for i in perm if ids[i] == "p2"]
        assert adv(group) == [whole[i] for i in group], name


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_baseline_estimators_refuse_one_sample_per_prompt(estimator):
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import ConfigError

    base = ["model.path=/nonexistent/tiny", "scheduler.update_batch_size=4", f"algorithm.advantage={estimator}"]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + ["rollout.n_samples_per_prompt=1"])
    msg = str(err.value)
    assert "\n" not in msg and "rollout.n_samples_per_prompt=1" in msg and estimator in msg
    assert set(A.GROUP_BASELINE) == {"grpo", "rloo", "reinforce_pp_baseline"}
    load_config(None, ["model.path=/nonexistent/tiny", "scheduler.update_batch_size=4", "rollout.n_samples_per_prompt=1",
                       "algorithm.advantage=reinforce_pp"])  # no baseline: one sample is fine


@pytest.mark.parametrize("override,key", [("algorithm.clip_ratio_c=1.0", "algorithm.clip_ratio_c"),
                                          ("algorithm.clip_ratio_c=-3", "algorithm.clip_ratio_c"),
                                          ("algorithm.log_ratio_clamp=-1", "algorithm.log_ratio_clamp")])
def test_loss_option_ranges(override, key):
    from megatron_sortedrl.config import load_config
    from megatron_sortedrl.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        load_config(None, ["model.path=/nonexistent/tiny", override])
    cfg = load_config(None, ["model.path=/nonexistent/tiny", "algorithm.clip_ratio_c=0", "algorithm.log_ratio_clamp=0"])
    assert cfg.algorithm.clip_ratio_c == 0 and cfg.algorithm.log_ratio_clamp == 0
    defaults = load_config(None, ["model.path=/nonexistent/tiny"]).algorithm
    assert (defaults.clip_ratio_c, defaults.log_ratio_clamp) == (3.0, 20.0)  # verl's defaults


def test_clip_statistics_by_side_and_kl_to_the_old_policy():
    """Hand-computed: ratios 1.5 (A > 0: held at 1 + 0.28), 0.5 (A < 0: held at 1 - 0.2), 1.1 (A > 0, inside),
    0.5 (A > 0: the unclipped branch is smaller, not clipped); ppo_kl is the mean of logp_old - logp."""
    import math

    import torch

    from megatron_sortedrl import algorithms as A

    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.5]])
    old = torch.zeros(1, 4)
    logp = ratio.log()
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    _, terms = A.policy_loss_per_token(logp, old, None, adv, clip_low=0.2, clip_high=0.28)
    assert terms["clip_frac_high"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert terms["clip_frac_low"].tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert (terms["clip_frac"] == terms["clip_frac_high"] + terms["clip_frac_low"]).all()
    expected = [-math.log(1.5), -math.log(0.5), -math.log(1.1), -math.log(0.5)]
    assert terms["ppo_kl"][0].tolist() == pytest.approx(expected, rel=1e-6)


def _naive_decoupled(logp, prox, behav, adv, mask, lo, hi, cap):
    """Decoupled PPO (asynchronous RL's objective), one token at a time: importance weight against the behaviour
    policy that sampled the token (truncated at `cap`), PPO clipping against the proximal policy; token mean."""
    total, count = 0.0, 0
    for lp_row, px_row, bh_row, a, m_row in zip(logp, prox, behav, adv, mask):
        for lp, px, bh, m in zip(lp_row, px_row, bh_row, m_row):
            if not m:
                continue
            w = min(math.exp(px - bh), cap)
            r = math.exp(lp - px)
            total += -w * min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            count += 1
    return total / count


@pytest.mark.parametrize("seed", range(5))
def test_decoupled_objective_matches_reference_across_behaviour_versions(seed):
    """Tokens of one sample sampled by different versions (an in-flight weight update mid-response) carry their
    own behaviour log-probs; the loss weights each by proximal/behaviour and clips the current policy against the
    proximal one, as the reference does token by token."""
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 9
    prox = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    spans = torch.randint(1, t, (b,), generator=g)  # tokens before the update came from an older version
    drift = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    behav = torch.where(torch.arange(t)[None, :] < spans[:, None], prox + drift, prox + drift * 0.1)
    logp = (prox + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.2).to(torch.float64)
    cap = 2.0
    loss, _ = A.policy_loss(logp, prox, adv[:, None].expand(b, t), mask, clip_low=0.2, clip_high=0.28,
                            logp_rollout=behav, tis_cap=cap)
    ref = _naive_decoupled(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, cap)
    assert loss.item() == pytest.approx(ref, rel=1e-10, abs=1e-12)
    # The gradient on a token still inside the proximal band is -w * r * A / tokens, whatever the behaviour ratio.
    loss.backward()
    r = torch.exp(logp.detach() - prox)
    w = torch.clamp(torch.exp(prox - behav), max=cap)
    inside = ((r > 0.8) & (r < 1.28) & (mask > 0))
    expect = -(w * r * adv[:, None]) / mask.sum()
    assert torch.allclose(logp.grad[inside], expect[inside], rtol=1e-9, atol=1e-12)


def test_decoupled_objective_clips_against_the_proximal_policy_not_the_behaviour():
    """At the first step on a harvest the current policy is the proximal one: nothing is clipped even where the
    behaviour policy (several versions old) is far outside the band; the staleness only enters as the weight."""
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-3.0, 0.5]])  # ratios prox/behav of e^2 and e^-1.5: outside [0.8, 1.28]
    logp = prox.clone().requires_grad_(True)
    loss, m = A.policy_loss(logp, prox, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), clip_low=0.2, clip_high=0.28,
                            logp_rollout=behav, tis_cap=100.0)
    assert m["clip_frac"] == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, -torch.exp(prox - behav) / 2)
