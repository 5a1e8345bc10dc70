"""GPU-only trainer paths: Transformer Engine layer spec, NCCL, bf16, distributed optimizer, clipping, and
checkpoints that move between GPU and CPU.

    pytest tests/test_trainer_gpu.py -m gpu -q -s     # needs an NVIDIA GPU (`make gpu-check` runs it)

Two sets: the Ray trainer group with the Transformer Engine spec (skipped without TE or Ray), and a
single-rank `TrainerWorker` driven in this process (world size 1, NCCL, no Ray; the local layer spec when
TE is absent), which is what runs on a GPU machine that only has PyTorch and a carried megatron-core.
One GPU is enough: TP=PP=1, so the distributed optimizer shards over a DP group of one, which still runs
its code path. Skipped (with the reason) on machines without CUDA.

The checkpoint round trip runs each side in its own process (`python tests/test_trainer_gpu.py PHASE
...`, the `__main__` block below): GPU save, CPU load + save, GPU load.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.config import RunConfig, TinyModelConfig
from megatron_sortedrl.sample import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def _te_probe():
    """The trainer's own detection (imports `transformer_engine.pytorch` and builds megatron's TE spec), run
    in a subprocess so a broken TE cannot block it in this process."""
    code = "from megatron_sortedrl.trainer.kernels import probe_transformer_engine as p; r = p(); print(r.ok, r.why)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    ok, _, why = (out.stdout.strip().splitlines() or ["False"])[-1].partition(" ")
    return ok == "True", why or out.stderr.strip()[-300:]


@pytest.fixture(scope="module")
def gpu_group(tmp_path_factory):
    te_ok, why = _te_probe()
    if not te_ok:
        pytest.skip(f"Transformer Engine cannot be used here: {why}")
    import ray

    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup

    d = tmp_path_factory.mktemp("gpu") / "tiny"
    build_tiny_model(d, TinyModelConfig(seed=3))
    cfg = RunConfig()
    cfg.model.path = str(d)
    cfg.model.dtype = "bfloat16"
    cfg.cluster.device = "gpu"
    cfg.parallel.use_distributed_optimizer = True
    cfg.trainer.micro_batch_tokens = 64
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    group = TrainerGroup(cfg)
    yield group, d
    group.shutdown()
    ray.shutdown()


def _samples(n=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r = torch.randint(4, 100, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
        s = Sample(prompt_id=f"p{i // 2}", index=i % 2, prompt_tokens=torch.randint(4, 100, (5,), generator=g).tolist(),
                   response_tokens=r, reward=float(i % 2))
        s.rollout_logprobs = [-4.8] * len(r)
        out.append(s)
    return out


def test_te_spec_logprobs_match_transformers(gpu_group):
    from transformers import AutoModelForCausalLM

    group, d = gpu_group
    assert group.info[0]["use_te"] and group.info[0]["device"] == "cuda"
    samples = _samples()
    got = group.compute_logprobs(samples)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    diff = 0.0
    with torch.no_grad():
        for s, lp in zip(samples, got):
            seq = torch.tensor([s.prompt_tokens + s.response_tokens], device="cuda")
            ref = torch.log_softmax(hf(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            diff = max(diff, (ref[len(s.prompt_tokens) - 1:].cpu() - torch.tensor(lp)).abs().max().item())
    print(f"\nGPU bf16 TE spec: max |logprob - transformers bf16| = {diff:.3e}")
    assert diff < 0.1  # bf16 kernels differ; float32 parity is pinned by the CPU tests


def test_distributed_optimizer_steps_and_checkpoint(gpu_group, tmp_path):
    group, _ = gpu_group
    samples = _samples()
    pairs = [(s.prompt_tokens, s.response_tokens) for s in samples]
    losses = [group.sft_step(pairs)["loss"] for _ in range(5)]
    print(f"\nGPU SFT losses: {[round(x, 4) for x in losses]}")
    assert losses[-1] < losses[0]
    m = group.train_step(samples)
    assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"])
    bad = group.train_step(samples, [float("nan")] * len(samples))
    assert bad["skipped"] == 1.0
    before = group.compute_logprobs(samples)
    path = group.save_checkpoint(tmp_path / "iter_0000001")
    group.sft_step(pairs)
    group.load_checkpoint(path)
    after = group.compute_logprobs(samples)
    assert max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x, y)) < 1e-6
    assert Path(path, "COMPLETE.json").is_file()


# ------------------------------------------------------------------------ single rank, no Ray, any layer spec

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_config(model_dir, dtype: str, device: str = "gpu", grad_clip: float = 1.0) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(model_dir)
    cfg.model.dtype = dtype
    cfg.cluster.device = device
    cfg.parallel.use_distributed_optimizer = device == "gpu"
    cfg.trainer.micro_batch_tokens = 64
    cfg.trainer.grad_clip = grad_clip
    cfg.trainer.warmup_sft_lr = 3e-3
    cfg.rollout.temperature = 1.0
    return cfg


def _items(samples):
    return [{"prompt": s.prompt_tokens, "response": s.response_tokens} for s in samples]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from megatron_sortedrl.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("gpu1") / "tiny", TinyModelConfig(seed=3))


@pytest.fixture(scope="module")
def single_rank(tiny_dir):
    pytest.importorskip("megatron.core", reason="megatron-core is not importable (make gpu-check carries a wheel)")
    from megatron_sortedrl.trainer.worker import TrainerWorker

    w = TrainerWorker(single_rank_config(tiny_dir, "bfloat16"), 0, 1, "127.0.0.1", _free_port())
    info = w.setup()
    assert info["device"] == "cuda"
    yield w
    w.shutdown()


def hf_model(path, dtype):
    """transformers' model on the GPU; `dtype=` from 4.56 on (older versions ignore it), `torch_dtype=` before."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(path, **{key: dtype}).cuda().eval()


def _hf_logprobs(model, samples):
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor([s.prompt_tokens + s.response_tokens], device="cuda")
            lp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            out.append(lp[len(s.prompt_tokens) - 1:].cpu())
    return out


def test_single_rank_bf16_logprobs_match_transformers(single_rank, tiny_dir):
    """Tolerance: Megatron in bf16 must be no further from the float32 answer than transformers' own bf16
    forward is (factor 2 for different rounding points: fused vs separate norms, where the fp32 softmax
    sits), with a floor of 0.02 nats (about five bf16 steps of a log-prob near -4)."""
    samples = _samples()
    got = single_rank.logprobs(_items(samples))
    ref32 = _hf_logprobs(hf_model(tiny_dir, torch.float32), samples)
    ref16 = _hf_logprobs(hf_model(tiny_dir, torch.bfloat16), samples)
    err_megatron = max((torch.tensor(got[i]) - ref32[i]).abs().max().item() for i in range(len(samples)))
    err_hf = max((ref16[i] - ref32[i]).abs().max().item() for i in range(len(samples)))
    print(f"\nbf16 vs float32 transformers: megatron {err_megatron:.3e}, transformers bf16 {err_hf:.3e}")
    assert err_megatron <= max(2 * err_hf, 0.02)


def test_single_rank_steps_distributed_optimizer_and_clipping(single_rank):
    from megatron_sortedrl.trainer.optimizer import zero_grads

    w = single_rank
    inner = getattr(w.opt, "chained_optimizers", [w.opt])
    assert [type(o).__name__ for o in inner] == ["DistributedOptimizer"]
    items = _items(_samples())
    metrics = [w.train_step(items, "sft") for _ in range(5)]
    losses = [m["loss"] for m in metrics]
    print(f"\nsingle-rank bf16 SFT losses: {[round(x, 4) for x in losses]}")
    assert losses[-1] < losses[0]
    assert all(m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in metrics)
    # Clipping: Megatron's own clip on the distributed optimizer's fp32 main grads brings the norm to the bound.
    w._forward_backward(items, "sft")
    opt = inner[0]
    opt.prepare_grads()
    before = float(opt.get_grad_norm())
    bound = before / 4
    reported = float(opt.clip_grad_norm(bound))
    after = float(opt.get_grad_norm())
    zero_grads(w.opt, [w.model])
    print(f"clip: norm {before:.4f} -> {after:.4f} (bound {bound:.4f})")
    assert reported == pytest.approx(before, rel=1e-4) and after == pytest.approx(bound, rel=1e-3)


def test_gpu_checkpoint_loads_on_cpu_and_back(tiny_dir, tmp_path):
    """float32 throughout: GPU trains and saves; a CPU process loads it (same log-probs up to kernel
    rounding) and saves again; a GPU process loads that and reproduces the first log-probs exactly."""
    pytest.importorskip("megatron.core", reason="megatron-core is not importable")
    a, b = tmp_path / "gpu_ckpt", tmp_path / "cpu_ckpt"
    lp = {}
    phases = [("gpu-save", "-", a, {}), ("cpu-roundtrip", a, b, {"CUDA_VISIBLE_DEVICES": ""}), ("gpu-load", b, "-", {})]
    for phase, ckpt_in, ckpt_out, extra_env in phases:
        out = tmp_path / f"{phase}.json"
        env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                                         os.environ.get("PYTHONPATH", "")])}
        res = subprocess.run([sys.executable, __file__, phase, str(tiny_dir), str(ckpt_in), str(ckpt_out), str(out)],
                             env=env, capture_output=True, text=True, timeout=600, check=False)
        assert res.returncode == 0, f"{phase} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        lp[phase] = json.loads(out.read_text())
    gpu, cpu, back = lp["gpu-save"], lp["cpu-roundtrip"], lp["gpu-load"]
    d_cpu = max(abs(x - y) for k in gpu for x, y in zip(gpu[k], cpu[k]))
    d_back = max(abs(x - y) for k in gpu for x, y in zip(gpu[k], back[k]))
    print(f"\nfloat32 log-probs: GPU vs CPU after load {d_cpu:.3e}; GPU before vs after the round trip {d_back:.3e}")
    assert d_cpu < 1e-4  # same weights, different float32 kernels
    assert d_back <= 1e-6  # same weights and kernels: identical up to nondeterministic reductions


def _phase(phase: str, model_dir: str, ckpt_in: str, ckpt_out: str, out: str) -> None:
    from megatron_sortedrl.trainer.worker import TrainerWorker

    gpu = phase.startswith("gpu")
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # a float32 compare needs float32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    w = TrainerWorker(single_rank_config(model_dir, "float32", "gpu" if gpu else "cpu"), 0, 1, "127.0.0.1",
                      _free_port())
    w.setup()
    items = _items(_samples())
    if ckpt_in == "-":
        for _ in range(2):  # weights that differ from the files in model_dir
            w.train_step(items, "sft")
    else:
        w.load(ckpt_in, load_optimizer=False)
    lps = w.logprobs(items)
    if ckpt_out != "-":
        w.save(ckpt_out)
    Path(out).write_text(json.dumps({str(k): v for k, v in lps.items()}))
    w.shutdown()


if __name__ == "__main__":
    _phase(*sys.argv[1:6])
