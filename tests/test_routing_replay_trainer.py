"""Rollout routing replay (R3) in the trainer: `TrainerWorker`'s log-prob and training passes route every token to
the experts its sample carries, at one rank and at EP2; a batch without complete routes runs on the routers' own
choice. CPU, gloo, megatron-core, a tiny Qwen3-MoE (`tiny_model.build_tiny_qwen3`: 2 MoE layers, 8 experts, top-2,
4 query and 2 key/value heads so that TP2 splits them, router weights scaled so routing has no near-ties).

    pytest tests/test_routing_replay_trainer.py -q -s -m "not slow"   # one rank and EP2, about two minutes
    pytest tests/test_routing_replay_trainer.py -q -s                # also TP2 x EP2 (sequence parallelism)

The samples are `Sample` records whose `routed_experts` are random expert choices (what an engine routing
otherwise would return), turned into worker items by the group's own item builders (`TrainerGroup._item`,
`group._with_routes`). The reference forces the same routes with `RoutingReplay` on a single-rank model, one
sequence at a time (no micro-batching, no padding); the samples' rollout log-probs are set to those reference
log-probs, so the training pass's `mismatch/logp_abs_diff` is about 0 exactly when it replayed the routes.
Each layout is one world of spawned processes running `TrainerWorker` directly, as `test_trainer_qwen3.py` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_sortedrl.tiny_model import build_tiny_qwen3
from helpers import rank0_port

LAYERS, EXPERTS, TOPK = 2, 8, 2

N_SAMPLES = 6


def _samples(routes: bool = True) -> list:
    """Samples with random prompts and responses; their routes are random expert choices (distinct per row)."""
    from megatron_sortedrl.sample import RoutedExperts, Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(N_SAMPLES):
        plen, rlen = int(torch.randint(3, 10, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
        s = Sample(prompt_id=f"p{i // 2}", index=i % 2, prompt_tokens=torch.randint(4, 100, (plen,), generator=g).tolist(),
                   response_tokens=torch.randint(4, 100, (rlen,), generator=g).tolist(), reward=float(i % 2))
        choice = torch.rand(plen + rlen - 1, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK]
        s.routed_experts = RoutedExperts.from_array(choice.numpy(), EXPERTS) if routes else None
        out.append(s)
    return out


def _items(cfg, samples, rollout_logprobs=None) -> list[dict]:
    """The items `TrainerGroup` sends its ranks (routes ride along when algorithm.routing_replay is on)."""
    from megatron_sortedrl.trainer.group import TrainerGroup, _with_routes

    out = []
    for i, s in enumerate(samples):
        n = len(s.response_tokens)
        ex = {"advantages": [1.0 - 0.4 * i] * n}
        if rollout_logprobs is not None:
            ex["rollout_logprobs"] = list(rollout_logprobs[i])
        out.append(_with_routes(TrainerGroup._item(s.prompt_tokens, s.response_tokens, ex), s, cfg))
    return out


def _reference(cfg) -> dict:
    """Per-sample log-probs of a single-rank model, one sequence at a time: with each sample's routes forced by
    `RoutingReplay` ("forced") and on the routers' own choice ("own"). Needs this process's TP=PP=1 world."""
    from megatron_sortedrl.trainer.model import build_model, read_hf_config
    from megatron_sortedrl.trainer.moe import MoESettings
    from megatron_sortedrl.trainer.routing_replay import RoutingReplay, moe_layer_numbers
    from megatron_sortedrl.trainer.weights import load_hf_weights

    arch = read_hf_config(cfg.model.path)
    model = build_model(arch, torch.float32, moe=MoESettings(routing_replay=True))
    load_hf_weights(model, cfg.model.path, arch, use_te=False)
    model.eval()
    replay = RoutingReplay(model, moe_layer_numbers(arch))
    out = {"forced": [], "own": []}
    with torch.no_grad():
        for s in _samples():
            seq = torch.tensor([s.prompt_tokens + s.response_tokens])
            inp = seq[:, :-1]
            for kind in ("forced", "own"):
                if kind == "forced":
                    replay.set_routes(torch.from_numpy(s.routed_experts.array().astype("int64")))
                logits = model(inp, torch.arange(inp.shape[1])[None], None)[0, :, :arch.vocab_size]
                replay.clear()
                lp = torch.log_softmax(logits.float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
                out[kind].append(lp[len(s.prompt_tokens) - 1:].tolist())
    return out


def _rank(rank: int, world: int, model_dir: str, layout: dict, ports, out_dir: str, rollout_lp) -> None:
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    cfg = RunConfig()
    cfg.model.path = model_dir
    cfg.cluster.device = "cpu"
    cfg.trainer.micro_batch_tokens = 40  # several micro-batches, rows of different lengths padded together
    cfg.algorithm.routing_replay = True
    for key, value in layout.items():
        if key == "recompute":
            cfg.parallel.recompute.granularity = value
        else:
            setattr(cfg.parallel, key, value)
    w = TrainerWorker(cfg, rank, world, "127.0.0.1", rank0_port(rank, world, ports))
    w.setup()
    res = {"rank": rank, "reporter": w.reporter}
    if rollout_lp is None:  # the single-rank world also computes the reference
        ref = _reference(cfg)
        res["reference"] = rollout_lp = ref["forced"], ref["own"]
    forced = rollout_lp[0]
    with_routes, without = _samples(), _samples(routes=False)
    mixed = _samples()
    mixed[2].routed_experts = None  # e.g. generated before replay was switched on
    short = _samples()
    short[4].routed_experts = type(short[4].routed_experts).from_array(short[4].routed_experts.array()[:-1], EXPERTS)
    res["lp"] = {name: w.logprobs(_items(cfg, s)) for name, s in
                 (("replay", with_routes), ("none", without), ("mixed", mixed), ("short", short))}
    for name, s in (("replay", with_routes), ("none", without)):
        lg = w.loss_and_grads(_items(cfg, s, forced), "rl")
        res[f"train_{name}"] = {"metrics": lg.get("metrics"), "grads": lg.get("grads")}
    if layout.get("expert_model_parallel_size", 1) > 1:
        # An EP model has two optimizers (dense and expert parameters, megatron's ChainedOptimizer): after a
        # replayed update, its checkpoint round trip keeps the replayed log-probs. A checkpoint saved before the
        # first update loads too (it once failed: megatron saves no Adam step while the step is 0).
        w.load(w.save(str(Path(out_dir) / "ckpt0"), {}))
        res["lp"]["step0_load"] = w.logprobs(_items(cfg, with_routes))
        w.train_step(_items(cfg, with_routes, forced), "rl")
        res["lp"]["after_step"] = w.logprobs(_items(cfg, with_routes))
        w.load(w.save(str(Path(out_dir) / "ckpt"), {}))
        res["lp"]["after_load"] = w.logprobs(_items(cfg, with_routes))
    w.shutdown()
    torch.save(res, Path(out_dir) / f"{rank}.pt")


def run_layout(tmp: Path, model_dir: Path, rollout_lp=None, **layout) -> dict:
    p = layout
    world = (p.get("tensor_model_parallel_size", 1) * p.get("pipeline_model_parallel_size", 1)
             * p.get("data_parallel_size", 1))
    out = tmp / ("_".join(f"{k.split('_')[0]}{v}" for k, v in layout.items()) or "single")
    out.mkdir(parents=True)
    ports = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(world, str(model_dir), layout, ports, str(out), rollout_lp), nprocs=world,
                       join=True, start_method="spawn")
    parts = [torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))]
    merged: dict = {}
    for r in parts:
        if r["reporter"]:
            for name, lp in r["lp"].items():
                merged.setdefault(name, {}).update(lp)
    first = next(r for r in parts if r["rank"] == 0)
    res = {"lp": {name: [lp[i] for i in range(N_SAMPLES)] for name, lp in merged.items()},
           "reference": first.get("reference")}
    for key in ("train_replay", "train_none"):
        res[key] = {"metrics": next(r[key]["metrics"] for r in parts if r["reporter"] and r[key]["metrics"]),
                    "grads": first[key]["grads"]}
    return res


def max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("moe") / "qwen3_moe", moe=True, seed=3, num_experts=EXPERTS,
                            num_hidden_layers=LAYERS, num_experts_per_tok=TOPK)


@pytest.fixture(scope="module")
def single(moe_dir, tmp_path_factory) -> dict:
    return run_layout(tmp_path_factory.mktemp("runs"), moe_dir)


def check_replay(run: dict, forced, own, label: str) -> None:
    lp = run["lp"]
    d_forced, d_own = max_diff(lp["replay"], forced), max_diff(lp["replay"], own)
    print(f"\n{label}: max |logprob - forced-route reference| = {d_forced:.2e}; "
          f"vs the routers' own choice {d_own:.2e}")
    assert d_forced < 1e-5  # the log-prob pass replays the samples' routes ...
    assert d_own > 1e-2  # ... which are not the routers' own choice
    for name in ("none", "mixed", "short"):  # an incomplete batch runs on the routers' own choice, whole
        assert max_diff(lp[name], own) < 1e-5, name
    m, m_none = run["train_replay"]["metrics"], run["train_none"]["metrics"]
    print(f"{label}: training pass mismatch/logp_abs_diff {m['mismatch/logp_abs_diff']:.2e} with the routes, "
          f"{m_none['mismatch/logp_abs_diff']:.2e} without")
    assert m["routing_replay/replayed"] == 1.0 and m_none["routing_replay/replayed"] == 0.0
    assert m["mismatch/logp_abs_diff"] < 1e-5  # the training pass replays them too
    assert m_none["mismatch/logp_abs_diff"] > 1e-3


def assert_same_grads(run: dict, ref: dict) -> None:
    for key in ("train_replay", "train_none"):
        assert run[key]["metrics"]["loss"] == pytest.approx(ref[key]["metrics"]["loss"], abs=1e-6)
        for name, g in ref[key]["grads"].items():
            assert torch.allclose(run[key]["grads"][name], g, atol=1e-6, rtol=1e-4), (key, name)


def test_trainer_replays_sample_routes_at_one_rank(single):
    forced, own = single["reference"]
    check_replay(single, forced, own, "one rank")
    g, g_none = single["train_replay"]["grads"], single["train_none"]["grads"]
    assert any(not torch.allclose(g[n], g_none[n], atol=1e-6) for n in g)  # replay changes the update


def test_trainer_replays_sample_routes_at_ep2_with_full_recompute(moe_dir, single, tmp_path):
    """EP2 (DP2): tokens cross EP ranks after routing; full recompute replays each micro-batch in its backward;
    the EP2 trainer's checkpoint round trip."""
    forced, own = single["reference"]
    ep2 = run_layout(tmp_path, moe_dir, (forced, own), data_parallel_size=2, expert_model_parallel_size=2,
                     recompute="full")
    check_replay(ep2, forced, own, "EP2 x DP2, full recompute")
    assert_same_grads(ep2, single)
    assert ep2["lp"]["after_step"] != ep2["lp"]["replay"]  # the update moved the policy ...
    assert ep2["lp"]["step0_load"] == ep2["lp"]["replay"]  # a checkpoint from before any update loads back
    assert ep2["lp"]["after_load"] == ep2["lp"]["after_step"]  # ... and its checkpoint, saved at EP2, loads back


@pytest.mark.slow
def test_trainer_replays_sample_routes_at_tp2_ep2(moe_dir, single, tmp_path):
    """TP2 x EP2: sequence parallelism, each TP rank replays its own slice of every micro-batch's sequence."""
    forced, own = single["reference"]
    run = run_layout(tmp_path, moe_dir, (forced, own), tensor_model_parallel_size=2, expert_model_parallel_size=2,
                     expert_tensor_parallel_size=1)
    check_replay(run, forced, own, "TP2 x EP2")
    assert_same_grads(run, single)
