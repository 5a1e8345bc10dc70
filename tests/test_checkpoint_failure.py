"""A checkpoint write that fails part way (disk full) leaves the previous checkpoint the newest complete one.

    python -m pytest tests/test_checkpoint_failure.py -q      # 2 trainer ranks; 3.4 min measured at load 45, 15 s CPU

A real trainer group at TP=2 (two Ray actors, gloo) saves through megatron-core's torch_dist writer; the
fault hook (`megatron_sortedrl/faults.py`) raises `OSError(ENOSPC)` in every rank once all model and
optimizer shards of the second checkpoint are written. Expected: one `CheckpointError` whose line (as the
command line prints it) names the disk error and the checkpoint that stays newest, no partial directory
left, the first checkpoint untouched, and the group still in step (the next save and a load work).
The same failure through the `train` command is in tests/test_failure_repetition.py (slow).
"""

from __future__ import annotations

import errno
import os

import pytest

from megatron_sortedrl import faults
from megatron_sortedrl.cli import user_message
from megatron_sortedrl.errors import CheckpointError

pytest.importorskip("ray")
FAULT = "checkpoint.after_shards=enospc@iter_0000002"


def test_fault_spec_parses_point_action_and_match():
    os.environ[faults.ENV] = f"other.point=enospc,{FAULT}"
    try:
        faults.hit("checkpoint.after_shards", "iter_0000001")  # no match: nothing happens
        faults.hit("checkpoint.before", "iter_0000002")  # another point: nothing happens
        with pytest.raises(OSError) as err:
            faults.hit("checkpoint.after_shards", "iter_0000002")
        assert err.value.errno == errno.ENOSPC
    finally:
        del os.environ[faults.ENV]
    faults.hit("checkpoint.after_shards", "iter_0000002")  # unset: nothing happens


@pytest.fixture(scope="module")
def faulty_env():
    # Set before the module's Ray starts, so the trainer actors inherit it.
    os.environ[faults.ENV] = FAULT
    yield
    del os.environ[faults.ENV]


def test_disk_full_mid_save_keeps_previous_checkpoint(faulty_env, local_ray, tiny_model_dir, tmp_path):
    from megatron_sortedrl.config import RunConfig
    from megatron_sortedrl.trainer.checkpoint import find_latest_checkpoint
    from megatron_sortedrl.trainer.group import TrainerGroup

    cfg = RunConfig()
    cfg.model.path, cfg.cluster.device = str(tiny_model_dir), "cpu"
    cfg.parallel.tensor_model_parallel_size = 2
    root = tmp_path / "checkpoints"
    group = TrainerGroup(cfg)
    try:
        group.sft_step([([5, 6, 7], [8, 9, 10, 11])] * 2)  # real optimizer state to save and load back
        first = group.save_checkpoint(root / "iter_0000001", extra={"step": 1})
        marker = (root / "iter_0000001" / "COMPLETE.json").read_text()
        with pytest.raises(CheckpointError) as err:
            group.save_checkpoint(root / "iter_0000002", extra={"step": 2})
        line = user_message(err.value)
        assert "\n" not in line and "Traceback" not in line, line
        assert "iter_0000002 could not be written" in line and "No space left on device" in line
        assert "newest complete checkpoint is still iter_0000001" in line
        assert find_latest_checkpoint(root) == root / "iter_0000001" == type(root)(first)
        assert sorted(p.name for p in root.iterdir()) == ["iter_0000001"]  # no partial directory left
        assert (root / "iter_0000001" / "COMPLETE.json").read_text() == marker
        # Every rank left the failed save at the same collective: the group saves and loads again.
        group.save_checkpoint(root / "iter_0000003", extra={"step": 3})
        assert find_latest_checkpoint(root) == root / "iter_0000003"
        assert group.load_checkpoint(root / "iter_0000003") == {"step": 3}
    finally:
        group.shutdown()
