"""Trainer-rollout mismatch metrics and the corrections beside TIS (MIS, IcePop, sequence mask), against
hand-computed references on small tensors; then the trainer's metrics row on the tiny model.

    pytest tests/test_rollout_correction.py

CPU only. The trainer test runs one in-process gloo rank in a spawned child (megatron's state is per process).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sortedrl import algorithms as A
from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError

from stream_support import model_dir, run_child  # noqa: F401 - model_dir is a fixture

L = math.log
# one row, rollout log-probs all -1; the trainer's differ by log rho = 0, ln 2.5, -ln 3, ln 1.5
ROLL = torch.full((1, 4), -1.0, dtype=torch.float64)
OLD = ROLL + torch.tensor([[0.0, L(2.5), -L(3.0), L(1.5)]], dtype=torch.float64)


def test_mismatch_terms_match_hand_computed_values():
    t = A.mismatch_terms(OLD, ROLL)
    assert torch.allclose(t["mismatch/logp_abs_diff"], torch.tensor([[0.0, L(2.5), L(3.0), L(1.5)]], dtype=torch.float64))
    # k3 = rho - 1 - log rho
    k3 = [0.0, 1.5 - L(2.5), 1 / 3 - 1 + L(3.0), 0.5 - L(1.5)]
    assert torch.allclose(t["mismatch/k3_kl"], torch.tensor([k3], dtype=torch.float64))
    assert t["mismatch/ratio_out_of_band"].tolist() == [[0.0, 1.0, 1.0, 0.0]]  # 2.5 > 2, 1/3 < 0.5
    # the k3 estimate equals the reference-KL estimator with the roles set (samples drawn by the engine)
    assert torch.allclose(t["mismatch/k3_kl"], A.kl_k3(ROLL, OLD))
    # a wild token stays finite
    assert torch.isfinite(A.mismatch_terms(ROLL + 200.0, ROLL)["mismatch/k3_kl"]).all()


def test_mis_masks_instead_of_truncating():
    w, terms = A.rollout_correction(OLD, ROLL, mis_low=0.5, mis_high=2.0, tis_cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 1.5]], dtype=torch.float64))
    assert terms["correction/mis_masked"].tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert "tis_weight" not in terms  # MIS replaces the truncation
    # TIS alone truncates the same tokens instead: 2.5 -> 2, 1/3 kept
    w_tis, _ = A.rollout_correction(OLD, ROLL, tis_cap=2.0)
    assert torch.allclose(w_tis, torch.tensor([[1.0, 2.0, 1 / 3, 1.5]], dtype=torch.float64))


def test_icepop_masks_outside_the_beta_band_and_keeps_the_importance_weight():
    w, terms = A.rollout_correction(OLD, ROLL, icepop_beta=2.0, tis_cap=1.2)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 1.2]], dtype=torch.float64))
    assert terms["correction/icepop_masked"].tolist() == [[0.0, 1.0, 1.0, 0.0]]
    w, _ = A.rollout_correction(OLD, ROLL, icepop_beta=2.0, tis_cap=2.0)  # IcePop's rho * 1[1/b <= rho <= b]
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0, 1.5]], dtype=torch.float64))
    w, _ = A.rollout_correction(OLD, ROLL, icepop_beta=3.5)  # no importance weight: a pure mask
    assert w.tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_sequence_mask_uses_the_geometric_mean_and_the_max_deviation_over_trained_tokens():
    # row 0: log rho ln2, ln2, 0 and a padding token (log rho 10, mask 0); row 1: ln1.1, -ln1.1, ln1.9, padding
    log_rho = torch.tensor([[L(2), L(2), 0.0, 10.0], [L(1.1), -L(1.1), L(1.9), 10.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    roll = torch.full_like(log_rho, -2.0)
    old = roll + log_rho
    # geometric means: 2^(2/3) = 1.587 (leaves [1/1.5, 1.5]) and 1.9^(1/3) = 1.239 (inside)
    w, terms = A.rollout_correction(old, roll, mask, seq_geo_band=1.5)
    assert w.tolist() == [[0.0] * 4, [1.0] * 4]
    assert terms["correction/seq_masked"].tolist() == [[1.0] * 4, [0.0] * 4]
    # max deviations: ln 2 and ln 1.9 (the padding's 10 does not count): band 1.95 drops row 0 only, 1.8 both
    w, _ = A.rollout_correction(old, roll, mask, seq_token_band=1.95)
    assert w.tolist() == [[0.0] * 4, [1.0] * 4]
    w, _ = A.rollout_correction(old, roll, mask, seq_token_band=1.8)
    assert w.tolist() == [[0.0] * 4, [0.0] * 4]
    w, _ = A.rollout_correction(old, roll, mask, seq_token_band=2.1, seq_geo_band=1.6)
    assert w.tolist() == [[1.0] * 4, [1.0] * 4]
    # with TIS the kept row keeps its truncated importance weights
    w, _ = A.rollout_correction(old, roll, mask, seq_geo_band=1.5, tis_cap=1.5)
    assert torch.allclose(w[1, :3], torch.tensor([1.1, 1 / 1.1, 1.5], dtype=torch.float64)) and w[0].sum() == 0


def test_policy_loss_applies_the_weight_and_logs_the_mismatch_without_a_correction():
    adv = torch.tensor([[1.0, -1.0, 0.5, 2.0]], dtype=torch.float64)
    logp = OLD.clone().requires_grad_(True)
    plain, _ = A.policy_loss_per_token(logp, OLD, None, adv, clip_low=0.2, clip_high=0.28)
    # every correction off (tis_cap 0): the loss is the plain PPO one, the mismatch is still measured
    loss, terms = A.policy_loss_per_token(logp, OLD, ROLL, adv, clip_low=0.2, clip_high=0.28, tis_cap=0.0)
    assert torch.equal(loss, plain) and "tis_weight" not in terms
    assert terms["mismatch/ratio_out_of_band"].sum() == 2
    loss, terms = A.policy_loss_per_token(logp, OLD, ROLL, adv, clip_low=0.2, clip_high=0.28, mis_high=2.0,
                                          mis_low=0.5)
    assert torch.allclose(loss, plain * torch.tensor([[1.0, 0.0, 0.0, 1.5]], dtype=torch.float64))
    loss.sum().backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 3] != 0  # masked tokens: no gradient


@pytest.mark.parametrize("override, key", [("algorithm.icepop_beta=0.5", "algorithm.icepop_beta"),
                                           ("algorithm.mis_high=1", "algorithm.mis_high"),
                                           ("algorithm.mis_low=1.5", "algorithm.mis_low"),
                                           ("algorithm.seq_mask_geo_band=-2", "algorithm.seq_mask_geo_band")])
def test_bad_correction_values_are_refused_with_their_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_corrections_are_off_by_default():
    a = load_config(None, []).algorithm
    assert (a.mis_high, a.icepop_beta, a.seq_mask_geo_band, a.seq_mask_token_band) == (0, 0, 0, 0)


# ------------------------------------------------------------------------------------ the trainer's row

# per response token, rollout log-prob = trainer's + this offset (so log rho = -offset)
_OFFSETS = [0.0, 0.1, -0.2, 1.0, -0.05, 0.3, -1.2, 0.0]


def _trainer_mismatch(model_dir: str, out) -> None:
    try:
        from helpers import random_rl_samples
        from stream_support import in_process_group

        from megatron_sortedrl.config import RunConfig

        cfg = RunConfig()
        cfg.model.path = model_dir
        cfg.cluster.device = "cpu"
        cfg.algorithm.icepop_beta = 2.0
        group = in_process_group(cfg)
        samples = random_rl_samples(4, seed=3)
        lp = group.compute_logprobs(samples)
        offs = []
        for s, l in zip(samples, lp):
            o = [_OFFSETS[i % len(_OFFSETS)] for i in range(len(l))]
            s.rollout_logprobs = [a + b for a, b in zip(l, o)]
            offs += o
        metrics = group.loss_and_grads(samples, advantages=[1.0, -1.0, 0.5, -0.5])["metrics"]
        group.worker.shutdown()
        out.put({"metrics": metrics, "offsets": offs})
    except BaseException as exc:  # reach the test as an error, not a silent child exit
        out.put(RuntimeError(f"{type(exc).__name__}: {exc}"))


def test_trainer_logs_the_mismatch_of_every_step(model_dir):
    res = run_child(_trainer_mismatch, str(model_dir))
    m, offs = res["metrics"], torch.tensor(res["offsets"], dtype=torch.float64)
    log_rho = -offs
    n = len(offs)
    assert m["n_tokens"] == n
    assert m["mismatch/logp_abs_diff"] == pytest.approx(float(log_rho.abs().mean()), abs=1e-5)
    assert m["mismatch/k3_kl"] == pytest.approx(float((log_rho.exp() - 1 - log_rho).mean()), abs=1e-5)
    out = ((log_rho < L(0.5)) | (log_rho > L(2.0))).double().mean()
    assert m["mismatch/ratio_out_of_band"] == pytest.approx(float(out), abs=1e-6)
    assert m["correction/icepop_masked"] == pytest.approx(float(out), abs=1e-6)  # beta 2: the same band
