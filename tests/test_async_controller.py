"""Asynchronous admission and harvest (scheduler/asynchronous.py) and its simulator (scheduler/sim/async_sim.py).

    pytest tests/test_async_controller.py

The bound the controller guarantees is checked on random runs: whatever the generation times, the trainer's
speed and the order samples finish in, every sample is trained exactly once, whole groups, in mini-batches of
the configured size, at most `bound` optimizer steps after the weights that sampled its oldest token, and nothing
is discarded. CPU only; no engines (the simulator stands in for them).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from megatron_sortedrl.sample import Sample
from scheduler.asynchronous import AsyncController
from scheduler.history import LengthHistory


def drive(ctl: AsyncController, rng: random.Random, gen_s, train_s: float, push_every: int = 1):
    """A minimal event loop: admitted samples finish after `gen_s(sample)` seconds (tokens appended under the
    engines' version when they finish: the oldest token is at least as new as the weights at admission), the
    trainer takes `train_s` per step and pushes weights after every `push_every` steps (instantly)."""
    t, heap, seq = 0.0, [], 0
    version, busy_until, batch, since = 0, None, None, 0
    admitted_at: dict[str, int] = {}
    batches, ages = [], []
    while not ctl.done:
        for g in ctl.admit():
            for s in g.samples:
                admitted_at[s.sample_id] = version
                seq += 1
                heapq.heappush(heap, (t + gen_s(s), seq, s))
        if busy_until is None:
            batch = ctl.next_minibatch()
            if batch is not None:
                busy_until = t + train_s
                seq += 1
                heapq.heappush(heap, (busy_until, seq, "step"))
        assert heap, f"deadlock: {len(ctl.groups)} groups wait, steps {ctl.steps}"
        t, _, item = heapq.heappop(heap)
        if item == "step":
            ages.extend(ctl.stepped(batch))
            batches.append(batch)
            busy_until, since = None, since + 1
            if since >= push_every:
                version, since = version + 1, 0
                ctl.synced(version)
        else:
            item.append([1], [0.0], admitted_at[item.sample_id])  # sampled by the weights of its admission
            ctl.on_finished(item)
    return batches, ages


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10_000), prompts=st.integers(1, 24), n=st.sampled_from([1, 2, 4]),
       per_batch=st.integers(1, 4), bound=st.integers(0, 4), epochs=st.integers(1, 3),
       aware=st.booleans(), push_every=st.integers(1, 3), tail=st.floats(1.0, 50.0), partial=st.booleans())
def test_every_sample_trained_once_within_the_bound(seed, prompts, n, per_batch, bound, epochs, aware, push_every,
                                                    tail, partial):
    push_every = min(push_every, bound + 1)  # a bound below the push interval cannot hold (the simulator refuses it)
    rng = random.Random(seed)
    ids = [f"p{i}" for i in range(prompts)]
    slow = {p: rng.random() < 0.2 for p in ids}  # persistent long prompts, as the history sees them
    hist = LengthHistory()
    m = n * per_batch
    ctl = AsyncController(ids, n=n, mini_batch=m, bound=bound, num_epochs=epochs, seed=seed, history=hist,
                          length_aware=aware, from_finish=partial)

    def gen_s(s: Sample) -> float:
        hist.record(s.prompt_id, s.epoch, 100 if slow[s.prompt_id] else 1)
        return rng.expovariate(1.0) * (tail if slow[s.prompt_id] else 1.0)

    batches, ages = drive(ctl, rng, gen_s, train_s=rng.uniform(0.1, 3.0), push_every=push_every)
    trained = Counter(s.sample_id for b in batches for s in b)
    assert len(trained) == prompts * n * epochs and set(trained.values()) == {1}
    assert ctl.discarded == 0
    assert partial or max(ages) <= bound  # counted from completion (partial) the oldest tokens may be older
    assert ctl.steps == len(batches) == -(-prompts * n * epochs // m)  # the same steps as any policy on this data
    for b in batches[:-1]:
        assert len(b) == m
    for b in batches:  # whole groups
        groups = Counter((s.prompt_id, s.epoch) for s in b)
        assert set(groups.values()) == {n}


def test_feasibility_is_the_deadline_inequality():
    ctl = AsyncController(["a"], n=2, mini_batch=4, bound=1, num_epochs=1)
    assert ctl.feasible([], 0, (1, 8))          # 8 samples due by step 1: two steps of 4
    assert not ctl.feasible([], 0, (1, 9))
    assert not ctl.feasible([], 2, (1, 1))      # a deadline already passed
    assert ctl.feasible([], 0, (0, 4)) and not ctl.feasible([], 0, (0, 5))


def test_admission_stops_at_the_bound_and_resumes_after_a_step():
    ids = [f"p{i}" for i in range(10)]
    ctl = AsyncController(ids, n=2, mini_batch=4, bound=1, num_epochs=1, length_aware=False)
    first = ctl.admit()
    assert sum(len(g.samples) for g in first) == 8  # (bound + 1) mini-batches in flight, no more
    assert ctl.admit() == [] and ctl.next_minibatch() is None  # nothing finished yet: the trainer waits
    for g in first[:2]:
        for s in g.samples:
            ctl.on_finished(s)
    batch = ctl.next_minibatch()
    assert batch == first[0].samples + first[1].samples  # oldest first, whole groups
    ctl.stepped(batch)
    ctl.synced(1)
    assert sum(len(g.samples) for g in ctl.admit()) == 4  # one step made: one more mini-batch admitted


def test_due_group_blocks_the_trainer_rather_than_going_stale():
    ids = ["a", "b", "c"]
    ctl = AsyncController(ids, n=1, mini_batch=1, bound=0, num_epochs=1, length_aware=False)
    (g,) = ctl.admit()  # bound 0: one sample in flight, trained by the very next step
    assert ctl.next_minibatch() is None
    ctl.on_finished(g.samples[0])
    assert ctl.next_minibatch() == g.samples


def test_length_aware_admission_goes_longest_first_within_each_epoch():
    ids = [f"p{i}" for i in range(12)]
    hist = LengthHistory()
    lengths = {p: (i * 7) % 12 for i, p in enumerate(ids)}
    for p in ids[:9]:  # three prompts the history has not seen
        hist.record(p, 0, lengths[p])
    ctl = AsyncController(ids, n=1, mini_batch=2, bound=50, num_epochs=3, seed=1, history=hist)
    fifo = AsyncController(ids, n=1, mini_batch=2, bound=50, num_epochs=3, seed=1, length_aware=False)
    order, data = [], []
    while not ctl.exhausted:
        gs = ctl.admit()
        assert gs, "the bound is wide: everything is admissible"
        order += [(g.prompt_id, g.epoch) for g in gs]
    while not fifo.exhausted:
        data += [(g.prompt_id, g.epoch) for g in fifo.admit()]
    assert [ep for _, ep in order] == sorted(ep for _, ep in order)  # every epoch admitted within itself
    for e in range(3):
        got = [p for p, ep in order if ep == e]
        seen = [p for p, ep in data if ep == e]
        assert got[:9] == sorted(ids[:9], key=lambda p: -lengths[p])  # known prompts longest first
        assert got[9:] == [p for p in seen if p not in ids[:9]]  # unseen ones after them, in data order


def test_simulated_async_run_same_steps_as_sync_within_bound():
    from scheduler.sim.async_sim import simulate_any
    from scheduler.sim.sim_config import load_sim_config

    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [])
    sync = simulate_any(sim, run, "sync")
    n = run.rollout.n_samples_per_prompt
    for label, bound in (("async@s0", 0), ("async@s1", 1), ("async-fifo@s4", 4), ("async+histospec@s2", 2)):
        res = simulate_any(sim, run, label)
        fig = res.policy_stats["async"]
        assert res.optimizer_steps == sync.optimizer_steps  # equal footing
        assert fig["max_staleness_steps"] <= bound and fig["discarded"] == 0
        per_key = Counter(k for r in res.rounds for k in r["trained"])
        assert len(per_key) == sim.workload.num_prompts * sim.workload.num_epochs and set(per_key.values()) == {n}
        assert 0.0 <= fig["worker_bubble"] <= 1.0
        # nothing short-first: over the run the trained lengths are exactly the generated ones, and each window of
        # one epoch's steps trains within 15% of the run's mean length (the tiny data's epochs differ by ~10%)
        trained = sorted(n for r in res.rounds for n in r["response_lengths"])
        assert trained == sorted(res.policy_stats["generated_lengths"])
        assert fig["length_bias_max"] < 0.15
        assert all(r["oldest_age_steps"] <= bound and r["discarded"] == 0 for r in res.rounds)


def test_async_label_errors_are_one_line():
    from megatron_sortedrl.errors import UserError
    from scheduler.sim.async_sim import parse_label, simulate_any
    from scheduler.sim.sim_config import load_sim_config

    assert parse_label("async+histospec@t64s2k3") == ("async", True, {"t": 64, "s": 2, "k": 3})
    assert parse_label("twotier") is None
    with pytest.raises(UserError, match="t<trainer GPUs>"):
        parse_label("async@x3")
    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", [])
    with pytest.raises(UserError, match="trainer GPUs of its own"):
        simulate_any(sim, run, "async@t2")  # every GPU to the trainer: no engine left


def test_overlapped_limit_is_below_every_asynchronous_run_and_above_the_gpu_time():
    from scheduler.sim.async_sim import simulate_any
    from scheduler.sim.limit import overlapped_limit, physical_limit
    from scheduler.sim.sim_config import load_sim_config

    sim, run = load_sim_config("configs/sim_tiny_cpu.yaml", ["cluster.gpus=4", "cluster.gpus_per_node=4"])
    lim = physical_limit(sim, run)
    for t in (1, 2, 3):
        bound = overlapped_limit(lim, t)
        assert bound["total_s"] == max(bound["generation_s"], bound["training_s"])
        for label in (f"async@t{t}s1", f"async-fifo+histospec@t{t}s4"):
            assert simulate_any(sim, run, label).total_s >= bound["total_s"]
        # splitting GPUs cannot beat their time: max(a G / (G - t), b G / t) >= a + b, equal at the balanced split
        assert bound["total_s"] >= lim["throughput_s"] + lim["token_train_s"] - 1e-9
    with pytest.raises(ValueError):
        overlapped_limit(lim, 4)
