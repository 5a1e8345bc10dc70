"""Loading jsonl/parquet datasets in the verl/DAPO layout; malformed rows are named or counted, never lost."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_sortedrl.config import load_config
from megatron_sortedrl.data.loaders import LoadReport, load_files, load_prompts
from megatron_sortedrl.errors import DatasetError

VERL_ROW = {
    "data_source": "dapo_math",
    "prompt": [{"role": "user", "content": "What is 1+1? Put the answer in \\boxed{}."}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "2", "style": "rule"},
    "extra_info": {"index": "a1"},
}


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_verl_layout_jsonl_and_parquet(tmp_path):
    flat = {"prompt": "2+2=", "answer": "4", "id": 7}
    jl = _write_jsonl(tmp_path / "train.jsonl", [VERL_ROW, flat])
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), tmp_path / "more.parquet")
    prompts = load_files([str(jl), str(tmp_path / "more.parquet")], "prompt", "ground_truth")
    assert [p.prompt_id for p in prompts] == ["train:a1", "train:7", "more:a1"]
    assert prompts[0].ground_truth == "2" and prompts[0].source == "dapo_math"
    assert prompts[0].meta["messages"][0]["role"] == "user"
    assert prompts[1].text == "2+2=" and prompts[1].ground_truth == "4"
    assert prompts[2].text == prompts[0].text


BAD_ROWS = [
    ("not json {", "not valid JSON"),
    ('["a list"]', "expected an object"),
    ({"question": "x", "answer": "1"}, "no prompt at key 'prompt'"),
    ({"prompt": "   ", "answer": "1"}, "empty prompt"),
    ({"prompt": "x"}, "no ground truth"),
    ({"prompt": 5, "answer": "1"}, "prompt at 'prompt' is a int, expected a string or chat messages"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "'prompt' message 1 (user) has no 'content'"),
    # Chat rows are checked message by message, like flat rows (these passed before: they reached the template).
    ({"prompt": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], "answer": "1"},
     "'prompt' message 2 has role 'bot', expected one of system, user, assistant, tool"),
    ({"prompt": [{"content": "x"}], "answer": "1"}, "'prompt' message 1 has role None"),
    ({"prompt": [{"role": "user", "content": ["x"]}], "answer": "1"}, "'prompt' message 1 (user) has a list 'content'"),
    ({"prompt": [{"role": "system", "content": "s"}, "user: x"], "answer": "1"},
     "'prompt' message 2 is a str, expected a chat message"),
    ({"prompt": [], "answer": "1"}, "'prompt' is an empty list of chat messages"),
    # A row's tool schemas and tool state are checked at load too (they passed before and failed at a tool turn).
    ({"prompt": "x", "answer": "1", "tools": [{"type": "function", "function": "calculator"}]},
     "'tools' entry 1 is not a valid tool schema: \"function\" is a str, expected an object"),
    ({"prompt": "x", "answer": "1", "tools": ["calculator", {"function": {"name": "f", "parameters": "x"}}]},
     "'tools' entry 2 is not a valid tool schema: \"parameters\" of f is 'x', expected a JSON schema of type object"),
    ({"prompt": "x", "answer": "1", "tools": [{"type": "tool", "function": {"name": "f"}}]},
     "'tools' entry 1 is not a valid tool schema: \"type\" is 'tool', expected \"function\""),
    ({"prompt": "x", "answer": "1", "tools": [{"name": "f", "parameters": {"type": "object", "required": "a"}}]},
     "'tools' entry 1 is not a valid tool schema: \"parameters\" of f is not a JSON schema ("),
    ({"prompt": "x", "answer": "1", "extra_info": {"tools_kwargs": {"kv_store": {"create_kwargs": [1]}}}},
     "'extra_info.tools_kwargs.kv_store' is [1], expected an object"),
]


@pytest.mark.parametrize("bad, reason", BAD_ROWS)
def test_bad_row_stops_with_file_and_row(tmp_path, bad, reason):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, bad])
    with pytest.raises(DatasetError) as info:
        load_files([str(path)], "prompt", "ground_truth")
    assert f"{path}:2: malformed row: {reason}" in str(info.value)
    assert "on_bad_row=skip" in str(info.value)


def test_skip_mode_counts_every_bad_row(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]
    for i, (bad, _) in enumerate(BAD_ROWS):
        rows.insert(2 * i + 1, bad)
    rows.append({"prompt": "dup", "answer": "1", "id": 1})
    rows.append({"prompt": "dup again", "answer": "1", "id": 1})
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    report = LoadReport()
    prompts = load_files([str(path)], "prompt", "ground_truth", "skip", report)
    assert len(prompts) == 6 and report.loaded == 6
    assert len(report.skipped) == len(BAD_ROWS) + 1  # every malformed row plus the duplicate id
    assert any("duplicate prompt id 'd:1'" in s for s in report.skipped)
    assert report.loaded + len(report.skipped) == len(rows)  # nothing silently dropped


def test_missing_file_and_bad_format(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_files([str(tmp_path / "nope.jsonl")], "prompt", "ground_truth")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset format"):
        load_files([str(tmp_path / "x.csv")], "prompt", "ground_truth")
    (tmp_path / "trunc.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        load_files([str(tmp_path / "trunc.parquet")], "prompt", "ground_truth")


def test_load_prompts_from_config(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [VERL_ROW])
    cfg = load_config(None, ["data.task=file", f"data.train_files=[{path}]"])
    assert [p.ground_truth for p in load_prompts(cfg.data, "train")] == ["2"]
    cfg = load_config()
    train, held_out = load_prompts(cfg.data, "train"), load_prompts(cfg.data, "eval")
    assert len(train) == cfg.data.num_train_prompts and len(held_out) == cfg.data.num_eval_prompts
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held_out}


def test_empty_file_or_nothing_usable_is_one_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl holds no rows; point data\.train_files"):
        load_files([str(tmp_path / "empty.jsonl")], "prompt", "ground_truth")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="holds no rows"):
        load_files([str(tmp_path / "empty.parquet")], "prompt", "ground_truth")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "x"}, "not json"])
    with pytest.raises(DatasetError, match=r"no usable prompt in .*bad\.jsonl: all 2 rows were malformed"):
        load_files([str(bad)], "prompt", "ground_truth", "skip", LoadReport())
