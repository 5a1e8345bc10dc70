"""Atomic megatron-core `dist_checkpointing` (torch_dist) checkpoints of model, optimizer and trainer state.

    save_checkpoint(path, model, opt, sched, trainer_state)      # every rank (a collective)
    trainer_state = load_checkpoint(path, model, opt, sched)     # every rank; any TP/PP
    latest = find_latest_checkpoint(root)                        # newest complete checkpoint under root
    complete_checkpoints(root)                                   # all of them, oldest first (for pruning)

Layout of one checkpoint directory:

    <path>/                 torch_dist shards + metadata (model and optimizer; resharded on load)
    <path>/trainer_state.pt step counters, LR schedule, anything the caller adds (driver resume state); plain
                        data only: it is read with `torch.load(weights_only=True)`, which runs no code
    <path>/COMPLETE.json    written last; its presence is what makes the checkpoint valid

Atomicity: everything is written into `<parent>/.<name>.partial`; only after every rank has finished and
COMPLETE.json is fsynced is that directory renamed to `<path>` (an existing checkpoint at `<path>` is
moved aside first and deleted afterwards). A crash at any point leaves either the old checkpoint or the
new one, plus perhaps a `.partial` directory that the next save removes. A write that fails (disk full)
removes its partial directory and raises one `CheckpointError` naming the newest complete checkpoint;
`faults.py` can make it fail on purpose (`MSRL_FAULTS=checkpoint.after_shards=enospc`). `load_checkpoint` refuses a
directory without COMPLETE.json with a `CheckpointError`, and `find_latest_checkpoint` skips it. It also
refuses a checkpoint whose tensors do not match the model (missing or unknown names), instead of loading
what matches and leaving the rest at their initial values.

Checkpoints use Megatron's sharded keys, which are the same for the local (CPU) and Transformer Engine
(GPU) layer specs: the local spec maps its `input_layernorm.weight` / `pre_mlp_layernorm.weight` to TE's fused
`self_attention.linear_qkv.layer_norm_weight` / `mlp.linear_fc1.layer_norm_weight` when it builds its sharded
state. Only TE's `_extra_state` objects differ (TE's final RMSNorm has one, the local norm has none), so a
load tolerates requested `_extra_state` entries the checkpoint lacks, and ignores ones it holds that the model
does not ask for: a CPU or converter checkpoint loads into the TE model and back
(tests/test_checkpoint_specs.py).

Deliberately left out: asynchronous saving and keeping N checkpoints (the driver deletes old ones).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_sortedrl import faults
from megatron_sortedrl.errors import CheckpointError

MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.pt"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _sharded_state(model, opt, is_loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    if opt is None:  # model-only checkpoint (written by the HF -> Megatron converter)
        return {"model": model_sd}
    # Fresh Adam state is all zeros; saves a uniform layout. megatron-core may wrap the optimizer in a
    # ChainedOptimizer (no init_state_fn of its own, a list for its state_dict): after a model-only load, and
    # always for an expert-parallel MoE model (one optimizer for the dense parameters, one for the experts).
    for o in getattr(opt, "chained_optimizers", [opt]) if not is_loading else ():
        if not o.state_dict().get("state"):
            o.init_state_fn(o.optimizer, o.config)
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _zero_missing_steps(state_dict) -> None:
    """Gives every parameter state of a loaded optimizer state dict that has no Adam `step` the step 0.

    megatron-core saves the shared step only when it is truthy (`if step:` in `sharded_state_dict`), so a
    checkpoint written before the first update holds Adam moments without a step, and torch's Adam refuses
    such a state on load (KeyError 'step'). Step 0 is what the moments (zeros) mean."""
    if isinstance(state_dict, list):
        for part in state_dict:
            _zero_missing_steps(part)
        return
    if not isinstance(state_dict, dict):
        return
    state = state_dict.get("state")
    if isinstance(state, dict) and "param_groups" in state_dict:
        if "common_step" not in state:
            for param_state in state.values():
                if isinstance(param_state, dict) and param_state and "step" not in param_state:
                    param_state["step"] = torch.tensor(0.0)
        return
    for value in state_dict.values():
        _zero_missing_steps(value)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(path: str | Path, model, opt, sched, trainer_state: dict, meta: dict) -> Path:
    """Writes a checkpoint atomically (collective over all trainer ranks); returns its path.

    A write that fails (a full disk, a lost mount) on any rank removes the partial directory and raises one
    `CheckpointError` on rank 0 naming the newest complete checkpoint, which stays untouched. Only rank 0
    raises: the trainer group reads rank 0's answer, and an error on every rank would leave Ray's reports of
    the unread ones on stderr."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    final = Path(path).resolve()
    tmp = final.parent / f".{final.name}.partial"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if rank0:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by an earlier crash
            tmp.mkdir()
        except OSError as exc:
            error = exc
    if _first_error(error) is None:
        try:
            dist_checkpointing.save(_sharded_state(model, opt, is_loading=False), str(tmp))
            faults.hit("checkpoint.after_shards", final.name)
        except (OSError, CheckpointException) as exc:  # a shard write failed on some rank
            error = exc
        if _first_error(error) is None and rank0:
            try:
                _finish(final, tmp, trainer_state, sched, meta)
            except OSError as exc:
                error = exc
    error = _first_error(error)
    if error is not None:
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            latest = find_latest_checkpoint(final.parent)
            raise CheckpointError(
                f"checkpoint {final.name} could not be written to {final.parent} ({error}); the newest complete "
                f"checkpoint is still {latest.name if latest else 'none'}; free space there (or point "
                "checkpoint.dir elsewhere) and run the same command again to resume") from None
        return final
    return final


def _finish(final: Path, tmp: Path, trainer_state: dict, sched, meta: dict) -> None:
    """Rank 0, after every rank's shards: trainer state, the COMPLETE marker, then the rename into place."""
    state = dict(trainer_state)
    if sched is not None:
        state["lr_scheduler"] = sched.state_dict()
    torch.save(state, tmp / STATE_FILE)
    _fsync_write(tmp / MARKER, json.dumps({**meta, "saved_at": time.time()}, indent=1))
    old = final.parent / f".{final.name}.old"
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def _first_error(error: BaseException | None) -> str | None:
    """One line for the first failure on any rank (a collective: every rank calls it at the same point)."""
    mine = None if error is None else _one_line(error)
    if not dist.is_initialized():
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((e for e in every if e is not None), None)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip().splitlines()
    # torch's CheckpointException lists the failing ranks with tracebacks; the cause's last line names it
    line = next((ln.strip() for ln in reversed(text) if "Error" in ln), text[0] if text else type(exc).__name__)
    return line[:200]


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER}; the save was interrupted); "
            f"use the previous checkpoint, e.g. find_latest_checkpoint({str(path.parent)!r})")
    return json.loads((path / MARKER).read_text())


def load_checkpoint(path: str | Path, model, opt, sched, *, load_optimizer: bool = True) -> dict:
    """Loads model (and optimizer) state at this rank's TP/PP; returns the saved trainer state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = Path(path)
    read_meta(path)
    try:
        if load_optimizer:
            sharded = _sharded_state(model, opt, is_loading=True)
        else:
            sharded = {"model": model.sharded_state_dict()}
        # RETURN_UNEXPECTED: what this model asks for and the checkpoint lacks is dropped from the request and
        # returned (megatron calls it "unexpected"), instead of failing inside torch's load planner. That is
        # how a checkpoint without Transformer Engine's extra state (CPU, local spec, `convert`) loads into
        # the TE model; any other absent tensor is refused below.
        loaded, _, absent = dist_checkpointing.load(sharded, str(path), strict=StrictHandling.RETURN_UNEXPECTED)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # a shard file missing or cut short
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})") from None
    _refuse_absent(path, absent)
    _check_keys(path, model.load_state_dict(loaded["model"], strict=False))
    if load_optimizer:
        _zero_missing_steps(loaded["optimizer"])
        opt.load_state_dict(loaded["optimizer"])
    state = read_state(path)
    if sched is not None and "lr_scheduler" in state:
        sched.load_state_dict(state["lr_scheduler"])
    return state


def _refuse_absent(path: Path, absent: set[str]) -> None:
    """Refuses a checkpoint that lacks sharded tensors this model (or its optimizer) asked for; a missing
    `_extra_state` (Transformer Engine's FP8 metadata, absent from checkpoints of the local spec) is fine:
    the module keeps its own, which is what TE starts from anyway."""
    lacking = sorted(k for k in absent if not k.endswith("_extra_state"))
    if lacking:
        raise CheckpointError(f"checkpoint {path} does not match this model: it lacks {len(lacking)} tensor(s), "
                              f"e.g. {', '.join(lacking[:3])}; check model.path (the architecture must be the "
                              "one the checkpoint was saved from) and whether it was saved with an optimizer")


def _check_keys(path: Path, result) -> None:
    """Refuses a checkpoint that lacks tensors of this model or holds tensors it does not have. Megatron's
    `_extra_state` entries (Transformer Engine's FP8 metadata) are optional and a checkpoint from the other
    layer spec legitimately lacks or adds them, so they do not count."""
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    unexpected = [k for k in result.unexpected_keys if not k.endswith("_extra_state")]
    if missing or unexpected:
        what = "; ".join(f"{label} {len(keys)} tensor(s), e.g. {', '.join(keys[:3])}"
                         for label, keys in (("lacks", missing), ("has unknown", unexpected)) if keys)
        raise CheckpointError(f"checkpoint {path} does not match this model: it {what}; check model.path "
                              "(the architecture must be the one the checkpoint was saved from)")


def read_state(path: str | Path) -> dict:
    """The trainer state file of a checkpoint, read without executing code: only plain containers, numbers,
    strings, bytes and tensors load (`torch.load(weights_only=True)`), so opening someone else's checkpoint
    cannot run what a pickle would smuggle in."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}; it is not a trainer checkpoint of this project")
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler raises many types (IndexError on garbage, too)
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
        # torch's refusal is a paragraph; the line naming what the pickle wanted to run is the useful one
        if "Weights only load failed" in lines[0]:  # the restricted unpickler refused something it holds
            reason = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1])
            raise CheckpointError(f"checkpoint {path}: {STATE_FILE} holds more than plain data and was not loaded "
                                  f"({reason[:160]}); only load checkpoints you trust, and re-save them with this "
                                  "version") from None
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} could not be read as plain data "
                              f"({type(exc).__name__}: {lines[-1][:160]}); the file is damaged or was not written by "
                              "this project: resume from an earlier checkpoint (checkpoint.resume=<dir>) or start "
                              "over (checkpoint.resume=never)") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} holds a {type(state).__name__}, not a dict")
    return state


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first by (saved step, save time); incomplete ones are
    skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and not d.name.startswith(".") and is_complete(d):
            meta = json.loads((d / MARKER).read_text())
            found.append(((meta.get("step", -1), meta.get("saved_at", 0.0)), d))
    return [d for _, d in sorted(found)]


def find_latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint under `root` with the highest saved step (incomplete ones are skipped)."""
    done = complete_checkpoints(root)
    return done[-1] if done else None
