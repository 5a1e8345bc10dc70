"""Walks the table of bad inputs in docs/reliability.md: each row gets exactly its one line, exit 2.

    python -m pytest tests/test_reliability_table.py -q        # about 20 s: in-process, no Ray

Every row runs through the command line's `main()` in this process, in a scratch working directory (so
nothing is written into the checkout), with `ray.init` replaced by a function that raises: a row whose
input passed every check would fail here in a second instead of starting a run. Asserted per row: exit 2,
stderr is one line starting with `error:` that contains the documented text, no traceback. The table must
keep at least 40 rows, numbered 1..N.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_sortedrl.cli import main

REPO = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| (\d+) \| ([^|]+) \| `([^`]+)` \| `([^`]+)` \|$")


def table_rows() -> list[tuple[int, str, str, str]]:
    rows = []
    for line in (REPO / "docs" / "reliability.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows.append((int(m.group(1)), m.group(2).strip(), m.group(3), m.group(4)))
    return rows


ROWS = table_rows()


def test_table_has_at_least_40_numbered_rows():
    assert len(ROWS) >= 40 and [r[0] for r in ROWS] == list(range(1, len(ROWS) + 1))
    assert {area for _, area, _, _ in ROWS} >= {"config", "data", "model", "checkpoint", "CLI"}


class _Payload:
    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def _checkpoint(run: Path, state: object | None, complete: bool = True, raw: bytes | None = None) -> Path:
    d = run / "checkpoints" / "iter_0000001"
    d.mkdir(parents=True)
    if raw is not None:
        (d / "trainer_state.pt").write_bytes(raw)
    elif state is not None:
        torch.save(state, d / "trainer_state.pt")
    if complete:
        (d / "COMPLETE.json").write_text('{"step": 1}')
    return run


# A user's tool module with the mistakes the table names: a tool function and a tool class whose calls miss the
# `state` argument, a parser that takes two arguments, one that returns a list instead of a Parsed.
BAD_TOOLS = """
def one_arg(arguments):
    return "x"


one_arg.schema = {"type": "function", "function": {"name": "one_arg", "parameters": {"type": "object"}}}


class NoState:
    name = "no_state"
    schema = {"name": "no_state", "parameters": {"type": "object", "properties": {}}}

    def __call__(self, arguments):
        return "x"


def parse_two(text, tools):
    return None


def parse_list(text):
    return []
"""


def _moe_checkpoint(d: Path, experts: int, config_experts: int) -> Path:
    """A torch_dist checkpoint of one Qwen3-MoE layer with `experts` routed experts (only the tensors whose shapes
    `convert` compares), whose saved hf_config says `config_experts`."""
    import torch.distributed.checkpoint as dcp

    shapes = {"embedding.word_embeddings.weight": (128, 64), "decoder.layers.0.self_attention.linear_qkv.weight": (256, 64),
              "decoder.layers.0.self_attention.linear_proj.weight": (64, 128),
              "decoder.layers.0.mlp.router.weight": (experts, 64)}
    d.mkdir()
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save({k: torch.zeros(v) for k, v in shapes.items()}, checkpoint_id=str(d), no_dist=True)
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (d / "COMPLETE.json").write_text('{"step": 0, "tp": 1, "pp": 1, "model_type": "qwen3_moe"}')
    (d / "hf_config").mkdir()
    (d / "hf_config" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": config_experts, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    return d


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model_dir):
    """The prepared inputs the table's placeholders name (see the list above the table)."""
    t = tmp_path_factory.mktemp("bad_inputs")

    def write(name: str, text: str) -> Path:
        (t / name).write_text(text)
        return t / name

    (t / "scratch").mkdir()
    p = {"tiny": tiny_model_dir, "tmp": t / "scratch", "configs": REPO / "configs",
         "bad_yaml": write("bad.yaml", "rollout: [unclosed\n"), "list_yaml": write("list.yaml", "- a\n- b\n"),
         "env_yaml": write("env.yaml", "model:\n  path: ${oc.env:MSRL_NO_SUCH_VARIABLE}\n"),
         "empty_jsonl": write("empty.jsonl", ""),
         "bad_json": write("badjson.jsonl", '{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": "2+2=", \n'),
         "no_prompt": write("noprompt.jsonl", '{"question": "1+1=", "ground_truth": "2"}\n'),
         "no_answer": write("noanswer.jsonl", '{"prompt": "1+1="}\n'),
         "csv": write("data.csv", "prompt,answer\n1+1,2\n"), "bad_parquet": write("bad.parquet", "not parquet"),
         "plain_file": write("plain_file", "x")}
    p["bad_chat"] = write("badchat.jsonl", json.dumps({"prompt": [{"role": "user", "content": "1+1="},
                                                               {"role": "bot", "content": "="}],
                                                    "ground_truth": "2"}) + "\n")
    p["qwen3"] = t / "qwen3"
    p["qwen3"].mkdir()
    shape = json.loads((REPO / "configs" / "model_shapes" / "qwen2.5-7b-instruct" / "config.json").read_text())
    (p["qwen3"] / "config.json").write_text(json.dumps(
        {**shape, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
         "use_sliding_window": True}))
    shutil.copy(tiny_model_dir / "tokenizer.json", p["qwen3"])
    p["no_config"] = t / "no_config"
    p["no_config"].mkdir()
    shutil.copy(tiny_model_dir / "tokenizer_config.json", p["no_config"])
    p["no_template"] = t / "no_template"  # the tiny model without its chat template (a base model)
    shutil.copytree(tiny_model_dir, p["no_template"])
    tok_cfg = json.loads((p["no_template"] / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (p["no_template"] / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (p["no_template"] / "chat_template.jinja").unlink(missing_ok=True)
    p["no_tokenizer"] = t / "no_tokenizer"
    p["no_tokenizer"].mkdir()
    shutil.copy(tiny_model_dir / "config.json", p["no_tokenizer"])
    write("msrl_badreward.py", "def score(sample):\n    return 1.0\n\n\nNOT_CALLABLE = 3\n")
    write("msrl_brokentool.py", "import json\n\nVALUE = undefined_name + 1\n\n\ndef score(sample, ground_truth):\n"
          "    return 1.0\n")
    write("msrl_badtools.py", BAD_TOOLS)
    p["bad_tool_rows"] = write("badtools.jsonl", json.dumps({"prompt": "2*3=", "ground_truth": "6", "tools": [
        {"type": "function", "function": "calculator"}]}) + "\n")
    p["bad_lengths"] = write("bad_lengths.json", json.dumps({"p0": {"0": [12, "x"]}}))
    p["moe_ckpt"] = _moe_checkpoint(t / "moe_ckpt", experts=8, config_experts=4)
    p["empty_dir"] = t / "empty_dir"
    p["empty_dir"].mkdir()
    p["flag"] = t / "pwned"
    p["hostile_run"] = _checkpoint(t / "hostile", {"step": 1, "extra": {"x": _Payload(p["flag"])}})
    p["garbage_run"] = _checkpoint(t / "garbage", None, raw=b"this is not a torch file")
    p["nostate_run"] = _checkpoint(t / "nostate", None)
    p["sorted_run"] = _checkpoint(t / "sorted", {"step": 1, "extra": {"scheduler": {"policy": "sorted"}}})
    p["incomplete_run"] = _checkpoint(t / "incomplete", {"step": 1}, complete=False)
    sys.path.insert(0, str(t))
    yield p
    sys.path.remove(str(t))
    for name in ("msrl_badreward", "msrl_brokentool", "msrl_badtools"):
        sys.modules.pop(name, None)
    assert not p["flag"].exists(), "a checkpoint ran code while it was read"


@pytest.fixture
def no_run(monkeypatch, tmp_path):
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("this input passed every check and reached ray.init")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.chdir(tmp_path)  # defaults such as runs/tiny_cpu land here, not in the checkout
    monkeypatch.delenv("MSRL_NO_SUCH_VARIABLE", raising=False)


@pytest.mark.parametrize("number, area, command, text", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_bad_input_gets_its_one_line(number, area, command, text, inputs, no_run):
    filled = re.sub(r"\{(\w+)\}", lambda m: str(inputs.get(m.group(1), m.group(0))), command)  # {rope_type: x} stays
    argv = shlex.split(filled)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse exits by itself
            rc = exc.code
    lines = err.getvalue().strip().splitlines()
    assert rc == 2, f"row {number}: exit {rc}; stderr: {err.getvalue()[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"row {number}: {lines}"
    assert text in lines[0], f"row {number}: {lines[0]!r} lacks {text!r}"
    assert "Traceback" not in err.getvalue() + out.getvalue()
