"""Opening a checkpoint executes nothing and loads nothing silently wrong. CPU only, < 5 s.

    python -m pytest tests/test_checkpoint_safety.py -q

The trainer state file is read with `torch.load(weights_only=True)`: a pickle that would run code on load is
refused with one line, and the code does not run. A checkpoint whose tensors do not match the model is
refused instead of being half loaded.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.errors import CheckpointError
from megatron_sortedrl.trainer.checkpoint import MARKER, STATE_FILE, _check_keys, read_state


class _Payload:
    """Unpickling this calls os.system: what a hostile checkpoint would do."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _checkpoint_dir(tmp_path: Path, state: object) -> Path:
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    torch.save(state, ckpt / STATE_FILE)
    (ckpt / MARKER).write_text("{}")
    return ckpt


def test_plain_run_state_round_trips(tmp_path):
    """What the driver stores: counters, RNG state, nested dicts and lists, bytes, tensors."""
    state = {"step": 7, "lr_scheduler": {"last_epoch": 7, "base_lrs": [1e-4]},
             "extra": {"rng": random.getstate(), "histospec": {"format": 1, "snapshot": b"\x00\xffabc"},
                       "scheduler": {"live": [{"prompt_id": "p1", "samples": [{"tokens": [1, 2], "reward": None}]}]},
                       "clock_epoch": 1.7e9, "probe": torch.arange(3)}}
    out = read_state(_checkpoint_dir(tmp_path, state))
    random.setstate(out["extra"]["rng"])  # the RNG state comes back usable, not just equal-looking
    assert out["extra"]["rng"] == state["extra"]["rng"]
    assert out["extra"]["histospec"]["snapshot"] == b"\x00\xffabc"
    assert torch.equal(out["extra"]["probe"], torch.arange(3))
    assert out["extra"]["scheduler"] == state["extra"]["scheduler"]


def test_state_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    flag = tmp_path / "pwned"
    ckpt = _checkpoint_dir(tmp_path, {"step": 1, "extra": {"x": _Payload(flag)}})
    with pytest.raises(CheckpointError) as err:
        read_state(ckpt)
    assert not flag.exists()
    msg = str(err.value)
    assert STATE_FILE in msg and "plain data" in msg and "\n" not in msg


def test_missing_state_file_is_one_line(tmp_path):
    ckpt = tmp_path / "iter_0000002"
    ckpt.mkdir()
    with pytest.raises(CheckpointError, match="has no trainer_state.pt"):
        read_state(ckpt)


def test_tensors_that_do_not_match_the_model_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    full = model.state_dict()
    assert _check_keys(Path("ok"), model.load_state_dict(full, strict=False)) is None
    partial = {k: v for k, v in full.items() if not k.startswith("1.")}
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor\(s\), e\.g\. 1\.weight, 1\.bias"):
        _check_keys(Path("ckpt"), model.load_state_dict(partial, strict=False))
    extra = {**full, "2.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"has unknown 1 tensor\(s\), e\.g\. 2\.weight"):
        _check_keys(Path("ckpt"), model.load_state_dict(extra, strict=False))
    # Transformer Engine's optional extra state never counts either way.
    with_extra = {**full, "0._extra_state": None}
    assert _check_keys(Path("ok"), model.load_state_dict(with_extra, strict=False)) is None
