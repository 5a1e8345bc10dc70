"""Hugging Face <-> Megatron torch_dist checkpoint conversion at any TP/PP (and EP for MoE models), on CPU.

    from megatron_sortedrl.convert.core import hf_to_mcore, mcore_to_hf, verify
    hf_to_mcore("models/qwen2.5-7b", "ckpt/qwen_tp2pp2", tp=2, pp=2)      # model-only torch_dist checkpoint
    hf_to_mcore("models/qwen3-30b-a3b", "ckpt/moe", tp=2, pp=2, ep=2, etp=1)   # experts split over 2 EP ranks
    mcore_to_hf("runs/x/checkpoints/iter_0000100", "out/hf", hf_config="models/qwen2.5-7b")
    verify("ckpt/qwen_tp2pp2", "models/qwen2.5-7b")                       # max |logit diff| (raises if off)

How: one CPU process per Megatron rank (TP*PP*DP of them, gloo; DP is 1 unless expert parallelism needs more
ranks per stage than TP: EP x expert TP must divide TP x DP), each running exactly the trainer's code:
`build_model` + `load_hf_weights` (reads only the tensors its shard needs, one at a time, through
`safe_open`) + `save_checkpoint`; export is `load_checkpoint` + `export_hf_weights` + `write_hf_dir`.
We use a world of processes rather than slicing HF tensors into torch_dist files in one process because
then the sharded keys, vocabulary padding and fused layouts are the trainer's by construction (the name
and layout table lives only in `trainer/weights.py`), and memory is spread: each process holds its own
shard plus at most one full HF tensor, so all processes together hold about 1x the model, not 2x.
Export at TP*PP ranks all-gathers one tensor at a time; rank 0 buffers at most one safetensors shard.

Outputs are atomic (written under `.<name>.partial`, renamed when complete), and everything that can be
checked up front (architecture, shards, shapes, TP/PP fit) is checked before any process starts. A rank
that fails writes its one-line error to a file and the launcher stops the other ranks it started.

hf-to-mcore checkpoints hold the model only (no optimizer); the trainer loads them with
`load_checkpoint(..., load_optimizer=False)`. They also keep the HF config and tokenizer files in
`<ckpt>/hf_config/`, so mcore-to-hf needs no `--hf-config` for them.

Deliberately left out: virtual pipeline stages, conversion on GPU (CPU is fast enough: it is I/O
bound), and converting optimizer state.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from megatron_sortedrl.errors import CheckpointError, UserError

HF_CONFIG_SUBDIR = "hf_config"


def _log(msg: str) -> None:
    print(f"[convert] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ rank side


def expert_dp(tp: int, ep: int, etp: int) -> int:
    """The fewest DP replicas whose TP x DP ranks per stage hold the EP x expert-TP expert groups."""
    import math

    return math.lcm(tp, ep * etp) // tp


def _init_rank(rank: int, world: int, port: int, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer import cpu_compat

    torch.set_num_threads(1)  # ranks share the cores; conversion is I/O bound anyway
    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=60))
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    cpu_compat.seed_model_parallel(0)


def _rank_main(job: str, rank: int, world: int, port: int, kw: dict, err_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # Megatron's "Apex is not installed" notes, once per rank
    os.setpgrp()  # own process group: the launcher can end this rank with the helpers it starts
    try:
        _init_rank(rank, world, port, kw["tp"], kw["pp"], kw.get("ep", 1), kw.get("etp"))
        globals()[f"_job_{job}"](rank, **kw)
        import resource

        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        _log(f"rank {rank}: peak RSS {peak_mb:.0f} MiB")
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which exits non-zero
        one_line = str(exc).splitlines()[0] if isinstance(exc, UserError) and str(exc) else None
        Path(err_dir, f"rank{rank}.err").write_text(
            one_line or f"rank {rank} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        sys.exit(1)


def _job_hf_to_mcore(rank: int, *, hf: str, out: str, tp: int, pp: int, dtype: str, ep: int = 1,
                     etp: int | None = None) -> None:
    from megatron_sortedrl.trainer.checkpoint import save_checkpoint
    from megatron_sortedrl.trainer.model import build_model, read_hf_config
    from megatron_sortedrl.trainer.weights import load_hf_weights

    arch = read_hf_config(hf)
    model = build_model(arch, getattr(torch, dtype), use_te=False)
    load_hf_weights(model, hf, arch, use_te=False)
    if rank == 0:
        _log("loaded HF weights into the rank shards; writing torch_dist")
    meta = {"step": 0, "tp": tp, "pp": pp, "dp": expert_dp(tp, ep, etp or tp), "ep": ep, "etp": etp or tp,
            "model_type": arch.model_type, "model_only": True,
            "source": str(Path(hf).resolve()), "dtype": dtype}
    save_checkpoint(out, model, None, None, {"step": 0, "skipped_steps": 0, "extra": {}}, meta)


def _job_mcore_to_hf(rank: int, *, ckpt: str, out: str, hf_config: str, tp: int, pp: int, dtype: str, ep: int = 1,
                     etp: int | None = None) -> None:
    from megatron_sortedrl.trainer.checkpoint import load_checkpoint
    from megatron_sortedrl.trainer.model import build_model, read_hf_config
    from megatron_sortedrl.trainer.hf_files import write_hf_dir
    from megatron_sortedrl.trainer.weights import export_hf_weights, hf_shapes

    arch = read_hf_config(hf_config)
    model = build_model(arch, getattr(torch, dtype), use_te=False)
    load_checkpoint(ckpt, model, None, None, load_optimizer=False)
    tensors = export_hf_weights(model, arch, use_te=False)
    if rank != 0:
        for _ in tensors:  # every rank takes part in the collective
            pass
        return
    total, t0 = len(hf_shapes(arch)), time.time()

    def progress():
        for i, (name, t) in enumerate(tensors, 1):
            if i % max(1, total // 20) == 0 or i == total:
                _log(f"exported {i}/{total} tensors ({time.time() - t0:.1f}s)")
            yield name, t

    write_hf_dir(out, progress(), hf_config)


def _job_logits(rank: int, *, ckpt: str, hf_config: str, tp: int, pp: int, dtype: str, tokens: list,
                result: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_sortedrl.trainer.checkpoint import load_checkpoint
    from megatron_sortedrl.trainer.model import build_model, read_hf_config

    arch = read_hf_config(hf_config)
    model = build_model(arch, torch.float32, use_te=False)
    load_checkpoint(ckpt, model, None, None, load_optimizer=False)
    model.eval()
    ids = torch.tensor(tokens)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        local = model(ids, pos, None)  # [b, s, vocab / tp]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if rank == 0:
        torch.save(torch.cat(parts, dim=-1)[..., : arch.vocab_size], result)


# ----------------------------------------------------------------------------------------- launcher


def run_ranks(job: str, world: int, kw: dict) -> None:
    """Runs `_job_<job>` on `world` fresh CPU processes; raises UserError with the first rank's message."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="convert-err-") as err_dir:
        procs = [ctx.Process(target=_rank_main, args=(job, r, world, port, kw, err_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        failed = None
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                failed = True
                break
            time.sleep(0.2)
        if failed or any(p.exitcode != 0 for p in procs):
            _end(procs)  # the other ranks would wait in a collective forever
            errs = sorted(Path(err_dir).glob("rank*.err"))
            msg = errs[0].read_text() if errs else f"a conversion rank died (exit codes {[p.exitcode for p in procs]})"
            if "\n" in msg:  # an unexpected error: keep its traceback on stderr, one line for the user
                print(msg, file=sys.stderr)
                msg = msg.splitlines()[0]
            raise CheckpointError(msg)
        _end(procs)


def _end(procs) -> None:
    """Ends the rank processes this launcher started and their helpers (Megatron's async-save manager)."""
    import signal

    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL if p.is_alive() or p.exitcode else signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass  # group already gone
        p.join()


def _replace_guard(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it (it is replaced only when the "
                        f"new one is complete)")


def hf_to_mcore(hf: str | Path, out: str | Path, tp: int = 1, pp: int = 1, *, dtype: str | None = None,
                overwrite: bool = False, ep: int = 1, etp: int | None = None) -> Path:
    """HF directory -> model-only Megatron torch_dist checkpoint laid out for TP=tp, PP=pp, EP=ep and expert
    TP=etp (None: tp)."""
    from megatron_sortedrl.convert.validate import check_hf_dir, check_layout
    from megatron_sortedrl.trainer.hf_files import HF_SIDE_FILES

    hf, out = Path(hf).resolve(), Path(out).resolve()
    arch = check_hf_dir(hf)
    check_layout(arch, tp, pp, ep, etp)
    etp = etp or tp
    world = tp * pp * expert_dp(tp, ep, etp)
    _replace_guard(out, overwrite)
    dtype = dtype or str(arch.raw.get("torch_dtype") or arch.raw.get("dtype") or "float32").replace("torch.", "")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"dtype {dtype!r} is not supported; expected float32, bfloat16 or float16")
    _log(f"{hf} -> {out} (torch_dist, TP={tp}, PP={pp}, EP={ep}, ETP={etp}, {dtype}, {world} CPU processes)")
    t0 = time.time()
    run_ranks("hf_to_mcore", world, {"hf": str(hf), "out": str(out), "tp": tp, "pp": pp, "ep": ep, "etp": etp,
                                     "dtype": dtype})
    side = out / HF_CONFIG_SUBDIR  # the checkpoint is complete already; these files only help export
    side.mkdir(exist_ok=True)
    for f in HF_SIDE_FILES:
        if (hf / f).is_file():
            shutil.copy(hf / f, side / f)
    _log(f"done in {time.time() - t0:.1f}s: {out}")
    return out


def mcore_to_hf(ckpt: str | Path, out: str | Path, hf_config: str | Path | None = None, *,
                tp: int | None = None, pp: int | None = None, overwrite: bool = False, ep: int | None = None,
                etp: int | None = None) -> Path:
    """Megatron checkpoint (from hf_to_mcore or a training run) -> HF directory (safetensors + config)."""
    from megatron_sortedrl.convert.validate import check_layout
    from megatron_sortedrl.trainer.model import padded_vocab_size

    ckpt, out = Path(ckpt).resolve(), Path(out).resolve()
    meta, cfg_dir, arch = _checked_source(ckpt, hf_config)
    tp, pp = tp or int(meta.get("tp", 1)), pp or int(meta.get("pp", 1))
    ep = ep or (int(meta.get("ep", 1)) if arch.num_experts else 1)
    etp = etp or (int(meta.get("etp", tp)) if ep > 1 else tp)
    check_layout(arch, tp, pp, ep, etp)
    if padded_vocab_size(arch, tp) != padded_vocab_size(arch, int(meta.get("tp", tp))):
        raise UserError(f"--tp {tp} pads the vocabulary ({arch.vocab_size}) differently from the checkpoint's TP "
                        f"{meta.get('tp')}; use --tp {meta.get('tp')}")
    _replace_guard(out, overwrite)
    dtype = meta.get("dtype") or str(arch.raw.get("torch_dtype") or arch.raw.get("dtype") or "float32")
    _log(f"{ckpt} -> {out} (HF safetensors, read at TP={tp}, PP={pp}, EP={ep}, ETP={etp}, {dtype})")
    t0 = time.time()
    run_ranks("mcore_to_hf", tp * pp * expert_dp(tp, ep, etp), {"ckpt": str(ckpt), "out": str(out),
                                                                "hf_config": str(cfg_dir), "tp": tp, "pp": pp,
                                                                "ep": ep, "etp": etp, "dtype": dtype})
    _log(f"done in {time.time() - t0:.1f}s: {out}")
    return out


def _checked_source(ckpt: Path, hf_config: str | Path | None):
    """(meta, config dir, HFArch) of a Megatron checkpoint and the HF config to read it with, after checking that
    the config describes the checkpoint's model (family and every shape; convert/validate.py)."""
    from megatron_sortedrl.convert.validate import check_config_matches, check_mcore_dir
    from megatron_sortedrl.trainer.model import read_hf_config

    meta = check_mcore_dir(ckpt)
    cfg_dir = _config_dir(ckpt, hf_config)
    arch = read_hf_config(cfg_dir)
    if meta.get("model_type") and meta["model_type"] != arch.model_type:
        raise UserError(f"{ckpt} holds a {meta['model_type']} model but {cfg_dir}/config.json is {arch.model_type}")
    check_config_matches(ckpt, arch, meta, f"{cfg_dir}/config.json")
    return meta, cfg_dir, arch


def _config_dir(ckpt: Path, hf_config: str | Path | None) -> Path:
    if hf_config:
        return Path(hf_config).resolve()
    if (ckpt / HF_CONFIG_SUBDIR / "config.json").is_file():
        return ckpt / HF_CONFIG_SUBDIR
    raise UserError(f"{ckpt} has no {HF_CONFIG_SUBDIR}/config.json; pass --hf-config <the HF model dir it was "
                    f"trained from>")


def verify(ckpt: str | Path, hf_dir: str | Path, *, hf_config: str | Path | None = None, n_prompts: int = 3,
           seq_len: int = 16, atol: float = 1e-3) -> float:
    """Loads both sides on CPU in float32 and compares logits on a few prompts; returns the max abs diff."""
    from transformers import AutoModelForCausalLM

    ckpt, hf_dir = Path(ckpt).resolve(), Path(hf_dir).resolve()
    meta, cfg_dir, arch = _checked_source(ckpt, hf_config)
    tp = int(meta.get("tp", 1))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (n_prompts, seq_len), generator=gen)
    with tempfile.TemporaryDirectory(prefix="convert-verify-") as tmp:
        result = str(Path(tmp) / "logits.pt")
        _log(f"verify: Megatron logits at TP={tp}, PP=1 on {n_prompts} prompts")
        run_ranks("logits", tp, {"ckpt": str(ckpt), "hf_config": str(cfg_dir), "tp": tp, "pp": 1,
                                 "dtype": "float32", "tokens": tokens.tolist(), "result": result})
        mc = torch.load(result)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    diff = (mc - ref).abs().max().item()
    _log(f"verify: max |logit diff| Megatron vs transformers = {diff:.3g} (tolerance {atol:g})")
    if not diff <= atol:
        raise CheckpointError(f"verify failed: max |logit diff| {diff:.3g} > {atol:g} between {ckpt} and {hf_dir}")
    return diff
