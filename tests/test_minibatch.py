"""Mini-batch updates (megatron_sortedrl/minibatch.py, TrainerGroup.train_minibatches).

    pytest tests/test_minibatch.py -q

Hardware: CPU only. The cut itself is checked by property tests (no group split, every mini-batch the
configured size, the same optimizer steps for any partition of the same data into harvests, staleness in steps
equal to version staleness at one step per harvest). The Megatron trainer (TP=1, in a spawned child) shows
that k mini-batch steps on one harvest are bit-identical to k sequential updates with the harvest's old
log-probs held fixed, that one mini-batch is bit-identical to the update before mini-batches existed, and that
the PPO clip binds (clip fraction and KL to the old policy non-zero) only once the proximal policy is not the
current one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stream_support import model_dir  # noqa: F401 - the stream tests' tiny model fixture

from megatron_sortedrl.config import load_config
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.minibatch import MiniBatcher, group_key, split_minibatches, staleness_metrics
from megatron_sortedrl.sample import Sample


def _groups(sizes: list[int], epoch: int = 0) -> list[Sample]:
    return [Sample(prompt_id=f"p{g}", index=i, epoch=epoch) for g, n in enumerate(sizes) for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=30), st.integers(0, 20))
def test_no_group_is_split_and_nothing_is_lost(sizes, size):
    samples = _groups(sizes)
    batches, rest = split_minibatches(samples, size)
    flat = [s for b in batches for s in b] + rest
    assert [s.sample_id for s in flat] == [s.sample_id for s in samples]  # every sample once, order kept
    seen: dict = {}
    for k, part in enumerate(batches + [rest]):
        for s in part:
            assert seen.setdefault(group_key(s), k) == k  # a group lives in one mini-batch (or the remainder)
    if size > 0:
        assert all(len(b) >= size for b in batches) and len(rest) < size
    else:
        assert len(batches) == (1 if samples else 0) and not rest


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 40), st.data())
def test_every_partition_into_harvests_makes_the_same_steps(n, groups_per_mb, num_groups, data):
    """Whole groups of n, mini-batches of a multiple of n: each is exactly `size` samples, and however the same
    groups are harvested (one round, many small ones, uneven ones) the optimizer steps are the same."""
    size, epochs = n * groups_per_mb, data.draw(st.integers(1, 3))
    samples = _groups([n] * num_groups)
    cuts = sorted(data.draw(st.lists(st.integers(0, num_groups), max_size=8)))
    bounds = [0, *cuts, num_groups]
    batcher = MiniBatcher(size, epochs)
    steps = 0
    for a, b in zip(bounds, bounds[1:]):
        batches = batcher.plan(samples[a * n:b * n])
        assert all(len(mb) == size for mb in batches)
        steps += batcher.optimizer_steps(batches)
    final = batcher.plan([], flush=True)
    steps += batcher.optimizer_steps(final)
    assert steps == epochs * (num_groups // groups_per_mb + (1 if num_groups % groups_per_mb else 0))


def test_size_zero_is_one_step_per_harvest():
    batcher = MiniBatcher(0)
    for n_groups in (3, 1, 5):
        assert batcher.optimizer_steps(batcher.plan(_groups([2] * n_groups))) == 1
    assert batcher.plan([], flush=True) == []


def test_staleness_in_steps_equals_versions_at_one_step_per_harvest_and_counts_steps_otherwise():
    def sample(pid: str, version: int) -> Sample:
        s = Sample(prompt_id=pid, index=0)
        s.append([1, 2], [0.0, 0.0], version)
        return s

    one = MiniBatcher(0)
    for version in range(1, 4):  # a harvest per version; each trains a sample two versions old
        batches = one.plan([sample(f"a{version}", max(0, version - 2)), sample(f"b{version}", version - 1)])
        assert one.staleness(batches) == [version - 1 - max(0, version - 2), 0]
        one.stepped(one.optimizer_steps(batches))
        one.synced(version)
    four = MiniBatcher(1)  # one sample per step: the k-th sample of a harvest is k steps older than its weights
    batches = four.plan([sample(f"c{i}", 0) for i in range(4)])
    assert four.staleness(batches) == [0, 1, 2, 3]
    four.stepped(4)
    four.synced(1)
    ages = four.staleness(four.plan([sample("d", 1), sample("e", 0)]))
    assert ages == [0, 5]
    assert staleness_metrics(ages) == {"staleness_steps_mean": 2.5, "staleness_steps_max": 5.0,
                                       "staleness_steps_hist": {"0": 1, "5": 1}}


def test_pending_remainder_survives_a_checkpoint():
    batcher = MiniBatcher(4)
    batcher.plan(_groups([2, 2, 2]))
    batcher.stepped(1)
    batcher.synced(1)
    again = MiniBatcher(4)
    again.load_state_dict(batcher.state_dict())
    assert [s.sample_id for s in again.pending] == [s.sample_id for s in batcher.pending] and len(again.pending) == 2
    assert again.steps == 1 and again.step_at_version == {0: 0, 1: 1}


def test_config_refuses_split_groups_and_stream_with_minibatches():
    with pytest.raises(ConfigError, match="algorithm.ppo_mini_batch_size"):
        load_config(None, ["rollout.n_samples_per_prompt=4", "algorithm.ppo_mini_batch_size=6"])
    with pytest.raises(ConfigError, match="trainer.stream"):
        load_config(None, ["algorithm.ppo_mini_batch_size=8", "trainer.stream=true"])
    cfg = load_config(None, ["rollout.n_samples_per_prompt=4", "algorithm.ppo_mini_batch_size=8", "algorithm.ppo_epochs=2"])
    assert (cfg.algorithm.ppo_mini_batch_size, cfg.algorithm.ppo_epochs) == (8, 2)


# ---------------------------------------------------------------------------------- the Megatron trainer

def _trainer_checks(model_dir: str, out) -> None:
    try:
        from helpers import random_rl_samples
        from stream_support import in_process_group

        from megatron_sortedrl.config import RunConfig
        from megatron_sortedrl.trainer.optimizer import build_optimizer, zero_grads
        from megatron_sortedrl.trainer.weights import load_hf_weights

        cfg = RunConfig()
        cfg.model.path = model_dir
        cfg.cluster.device = "cpu"
        cfg.trainer.lr = 3e-2  # large: a second step on the same data moves the ratio out of the clip band
        cfg.rollout.n_samples_per_prompt = 2
        group = in_process_group(cfg)
        w = group.worker

        def params():
            return {n: p.detach().clone().numpy() for n, p in w.module.named_parameters()}  # (a queue takes numpy)

        def fresh():
            load_hf_weights(w.module, model_dir, w.arch, use_te=False)
            w.opt, w.sched = build_optimizer([w.model], cfg, on_gpu=False)
            zero_grads(w.opt, [w.model])

        samples = random_rl_samples(12, seed=4)
        batches, _ = split_minibatches(samples, 4)  # three mini-batches of two groups
        adv = group.advantages(samples)
        res = {}
        fresh()
        merged = group.train_minibatches(batches, adv)
        res["minibatch"] = params()
        res["merged"] = merged
        fresh()
        old = group.compute_logprobs(samples)
        steps = []
        for k, mb in enumerate(batches):
            lo, hi = 4 * k, 4 * k + 4
            steps.append(group.train_step(mb, advantages=adv[lo:hi], old_logprobs=old[lo:hi]))
        res["sequential"] = params()
        res["steps"] = steps
        fresh()  # one mini-batch: the update as it was before mini-batches (train_step without old log-probs)
        res["one"] = group.train_minibatches([samples], adv)
        res["one_params"] = params()
        fresh()
        res["before"] = group.train_step(samples, advantages=adv)
        res["before_params"] = params()
        fresh()
        res["epochs"] = group.train_minibatches(batches, adv, epochs=2)
        out.put(res)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(exc)


@pytest.fixture(scope="module")
def trained(model_dir):
    from stream_support import run_child

    return run_child(_trainer_checks, str(model_dir))


def test_k_minibatch_steps_equal_k_sequential_updates_bitwise(trained):
    a, b = trained["minibatch"], trained["sequential"]
    assert a.keys() == b.keys()
    assert all(bool((a[k] == b[k]).all()) for k in a)
    assert trained["merged"]["optimizer_steps"] == 3.0
    assert trained["merged"]["n_tokens"] == sum(s["n_tokens"] for s in trained["steps"])
    assert trained["merged"]["ratio_max"] == max(s["ratio_max"] for s in trained["steps"])


def test_one_minibatch_is_the_update_before_minibatches_bitwise(trained):
    a, b = trained["one_params"], trained["before_params"]
    assert all(bool((a[k] == b[k]).all()) for k in a)
    assert trained["one"]["loss"] == trained["before"]["loss"]
    assert trained["one"]["optimizer_steps"] == 1.0


def test_clip_binds_only_after_the_first_step_on_a_harvest(trained):
    first = trained["steps"][0]
    assert first["clip_frac"] == 0.0 and abs(first["ppo_kl"]) < 1e-6 and abs(first["ratio_max"] - 1.0) < 1e-5
    later = trained["steps"][1:]
    # the old policy is the harvest's start: later mini-batches see a moved policy
    assert any(abs(s["ppo_kl"]) > 1e-4 for s in later)
    ep = trained["epochs"]  # the second epoch re-trains the same samples: ratios leave the band
    assert ep["optimizer_steps"] == 6.0
    assert ep["clip_frac"] > 0.0 and ep["ratio_max"] > 1.0 + 0.28
    assert ep["clip_frac"] == pytest.approx(ep["clip_frac_high"] + ep["clip_frac_low"], abs=1e-6)


@pytest.mark.slow  # two trainer groups of two ranks each: about 2 minutes per layout on 2 cores
@pytest.mark.parametrize("layout", ["data_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                    "expert_model_parallel_size"])
def test_minibatch_steps_at_two_ranks_equal_sequential_steps(tiny_model_dir, local_ray, layout, tmp_path):
    """Two gloo ranks through Ray, as the driver runs them, at DP=2, TP=2, PP=2 and EP=2 (DP=2 with the experts
    of a tiny Qwen3-MoE split over the two ranks): the group's old log-probs (gathered from both replicas at DP,
    from the last stage at PP) and its mini-batch steps give the same parameters as sequential steps with those
    log-probs."""
    from helpers import random_rl_samples

    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path = str(tiny_model_dir)
    cfg.cluster.device = "cpu"
    setattr(cfg.parallel, layout, 2)
    if layout == "expert_model_parallel_size":
        from megatron_sortedrl.tiny_model import build_tiny_qwen3

        cfg.model.path = str(build_tiny_qwen3(tmp_path / "moe", moe=True, seed=3, num_experts=4,
                                              num_hidden_layers=2, num_experts_per_tok=2))
        cfg.parallel.data_parallel_size = 2
    cfg.trainer.micro_batch_tokens = 48
    cfg.trainer.lr = 3e-2
    samples = random_rl_samples(12, seed=4)
    batches, _ = split_minibatches(samples, 4)

    def trained(minibatches: bool):
        group = TrainerGroup(cfg)
        try:
            adv = group.advantages(samples)
            if minibatches:
                metrics = group.train_minibatches(batches, adv)
            else:
                old = group.compute_logprobs(samples)
                metrics = [group.train_step(mb, advantages=adv[4 * k:4 * k + 4], old_logprobs=old[4 * k:4 * k + 4])
                           for k, mb in enumerate(batches)]
            return metrics, group.export_hf_weights()
        finally:
            group.shutdown()

    merged, a = trained(True)
    steps, b = trained(False)
    assert merged["optimizer_steps"] == 3.0 and merged["ratio_max"] == max(s["ratio_max"] for s in steps)
    assert all(bool((a[k] == b[k]).all()) for k in a)
    assert any(s["ppo_kl"] != 0.0 for s in steps[1:])
