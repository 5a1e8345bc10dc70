"""Mistakes that used to surface only after Ray, the trainer and the engines had started (or as a traceback)
now stop `train` at once with one line and exit 2. CPU only; each case runs the real CLI in a subprocess and
must finish in seconds because nothing is started.

    python -m pytest tests/test_preflight.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import REPO


def bad_signature(sample):  # a reward that forgot the ground truth
    return 0.0


def _train(*overrides: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_sortedrl", "train", "configs/tiny_cpu.yaml", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.strip(), time.monotonic() - t0


def _checkpoint(root, policy: str):
    ckpt = root / "checkpoints" / "iter_0000003"
    ckpt.mkdir(parents=True)
    torch.save({"step": 3, "extra": {"scheduler": {"policy": policy}}}, ckpt / "trainer_state.pt")
    (ckpt / "COMPLETE.json").write_text(json.dumps({"step": 3, "saved_at": 1.0}))
    return ckpt


@pytest.mark.parametrize("case, expected", [
    ("no_model", "/nonexistent/model"),  # the launch planner, which reads config.json first, or preflight
    ("model_without_tokenizer", "has no tokenizer"),
    ("reward_not_importable", "data.reward_fn='no_such_pkg.mod.reward' is not allowed; expected an importable module"),
    ("reward_bad_signature", "expected a function taking (sample, ground_truth); it takes (sample)"),
    ("run_dir_not_writable", "logging.run_dir: "),
    # These were found at the first checkpoint or metrics write, after a step, as a trainer-rank traceback.
    ("checkpoint_dir_not_writable", "checkpoint.dir: "),
    ("tensorboard_dir_not_writable", "logging.tensorboard: "),
    ("resume_other_policy", "was written by scheduler.policy=sorted, the config says twotier"),
    ("elastic_planner", "scheduler.layout_cost_model='' is not allowed; expected a simulator YAML"),
    ("preemption_planner", "scheduler.layout_planner='preemption' is not allowed; expected fixed or cost_model in `train`"),
    ("chat_template_missing", "data.apply_chat_template=True is not allowed; expected false for the model at"),
])
def test_train_refuses_before_starting_anything(case, expected, tmp_path):
    run = tmp_path / "run"
    overrides = [f"logging.run_dir={run}"]
    if case == "no_model":
        overrides += ["model.path=/nonexistent/model", "model.build_tiny_if_missing=false"]
    elif case == "model_without_tokenizer":
        from megatron_sortedrl.tiny_model import build_tiny_model

        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text((build_tiny_model(tmp_path / "tiny") / "config.json").read_text())
        overrides += [f"model.path={model}"]
    elif case == "reward_not_importable":
        overrides += ["data.reward_fn=no_such_pkg.mod.reward"]
    elif case == "reward_bad_signature":
        overrides += ["data.reward_fn=tests.test_preflight.bad_signature"]
    elif case == "run_dir_not_writable":
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        overrides = [f"logging.run_dir={blocker / 'run'}"]  # a directory under a file: even root cannot
    elif case == "checkpoint_dir_not_writable":
        blocker = tmp_path / "a_file"
        blocker.write_text("")
        overrides += [f"checkpoint.dir={blocker / 'ckpt'}"]
    elif case == "tensorboard_dir_not_writable":
        run.mkdir()
        (run / "tensorboard").write_text("")  # a file where the directory goes
    elif case == "resume_other_policy":
        _checkpoint(run, "sorted")
    elif case == "elastic_planner":  # cost_model without the engine model its choice comes from
        overrides += ["scheduler.layout_planner=cost_model"]
    elif case == "preemption_planner":
        overrides += ["scheduler.layout_planner=preemption"]
    elif case == "chat_template_missing":
        from megatron_sortedrl.tiny_model import build_tiny_model

        model = build_tiny_model(tmp_path / "tiny")  # the tiny model has a chat template: take it away
        tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
        tok_cfg.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        (model / "chat_template.jinja").unlink(missing_ok=True)
        overrides += [f"model.path={model}", "data.apply_chat_template=true"]
    rc, err, seconds = _train(*overrides)
    assert rc == 2, err
    assert expected in err and "model.path" in err if case == "no_model" else expected in err, err
    if case.endswith("_not_writable"):
        assert "is not writable" in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not (run / "metrics.jsonl").exists()  # nothing ran
    assert seconds < 60  # no Ray, trainer or engine start (those alone take longer on this machine)
