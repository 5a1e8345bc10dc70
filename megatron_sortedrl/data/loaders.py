"""Prompt sources: procedural tasks, and local jsonl / parquet files in the verl / DAPO layout.

    from megatron_sortedrl.data import load_prompts
    train = load_prompts(cfg.data, "train")      # list[Prompt]

A file row is a JSON object (jsonl) or a table row (parquet). The prompt is read from `data.prompt_key`
(a dotted path; a string, or a list of chat messages `{"role", "content"}` as in verl's and DAPO-Math's
files), the ground truth from `data.answer_key`, falling back to `reward_model.ground_truth` (verl),
`answer` and `ground_truth`. Tools: a flat `tools` list (names or OpenAI-style schemas) narrows the run's
`tools.tools` for the row, and verl's multi-turn `extra_info.tools_kwargs` ({tool: arguments}) is the row's
initial tool state (`Prompt.meta["tools"]`, `["tools_kwargs"]`; docs/agentic.md). The prompt id is `extra_info.index` or `id` when present (so history stays
keyed on the same prompt across file reorderings), else `<file stem>:row<row>`.

A malformed row (not an object, no prompt, empty prompt, a chat message that is not a mapping with a known
`role` and a string `content`, no ground truth, duplicate id) raises a
`DatasetError` naming the file and the 1-based row, or with `data.on_bad_row=skip` is skipped and counted:
`LoadReport` lists every skipped row, so nothing is silently dropped.

Left out: remote datasets (nothing can be downloaded here; pass local files) and streaming of datasets
larger than memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megatron_sortedrl.errors import DatasetError
from megatron_sortedrl.sample import Prompt

GROUND_TRUTH_FALLBACKS = ("reward_model.ground_truth", "answer", "ground_truth")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # what the chat templates of the supported models render


@dataclass
class LoadReport:
    """What a load kept and what it skipped (file:row and why), for logs and the run report."""

    loaded: int = 0
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"{self.loaded} prompts loaded, {len(self.skipped)} malformed rows skipped"


def load_prompts(data_cfg, split: str = "train", report: LoadReport | None = None) -> list[Prompt]:
    """Prompts of `split` ("train" or "eval") as configured by a `DataConfig`."""
    report = report if report is not None else LoadReport()
    if data_cfg.task == "file":
        files = data_cfg.train_files if split == "train" else data_cfg.eval_files
        prompts = load_files(files, data_cfg.prompt_key, data_cfg.answer_key, data_cfg.on_bad_row, report)
    else:
        from megatron_sortedrl.data import (arithmetic, code_task, column_addition, knights_knaves, long_addition,
                                            tool_multiplication)

        generator = {"arithmetic": arithmetic.generate, "knights_knaves": knights_knaves.generate,
                     "long_addition": long_addition.generate, "column_addition": column_addition.generate,
                     "code": code_task.generate, "tool_multiplication": tool_multiplication.generate}[data_cfg.task]
        # Train and eval use different seeds so the held-out set is disjoint in expectation.
        seed = data_cfg.seed if split == "train" else data_cfg.seed + 1_000_003
        num = data_cfg.num_train_prompts if split == "train" else data_cfg.num_eval_prompts
        prompts = generator(num, seed, data_cfg.min_difficulty, data_cfg.max_difficulty, id_prefix=f"{data_cfg.task}-{split}")
        report.loaded += len(prompts)
    return prompts


def load_files(files: list[str], prompt_key: str, answer_key: str, on_bad_row: str = "error",
               report: LoadReport | None = None) -> list[Prompt]:
    report = report if report is not None else LoadReport()
    prompts: list[Prompt] = []
    seen: dict[str, str] = {}
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise DatasetError(f"dataset file not found: {path} (check data.train_files / data.eval_files)")
        rows_in_file = 0
        for row_no, row in _rows(path):
            rows_in_file += 1
            where = f"{path}:{row_no}"
            try:
                prompt = _to_prompt(row, path, row_no, prompt_key, answer_key)
                if prompt.prompt_id in seen:
                    raise ValueError(f"duplicate prompt id '{prompt.prompt_id}' (first at {seen[prompt.prompt_id]})")
            except ValueError as exc:
                if on_bad_row == "error":
                    raise DatasetError(f"{where}: malformed row: {exc} (fix the row or set data.on_bad_row=skip)") from None
                report.skipped.append(f"{where}: {exc}")
                continue
            seen[prompt.prompt_id] = where
            prompts.append(prompt)
            report.loaded += 1
        if rows_in_file == 0:
            raise DatasetError(f"{path} holds no rows; point data.train_files / data.eval_files at a non-empty "
                               ".jsonl or .parquet file")
    if files and not prompts:
        raise DatasetError(f"no usable prompt in {', '.join(files)}: all {len(report.skipped)} rows were malformed "
                           f"(first: {report.skipped[0] if report.skipped else '-'})")
    return prompts


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row) pairs; a line that is not JSON is yielded as a ValueError-carrying marker."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for row_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield row_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield row_no, _BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})")
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for truncated or foreign files
            raise DatasetError(f"{path}: cannot read parquet file ({type(exc).__name__}: {exc})") from None
        for row_no, row in enumerate(table.to_pylist(), start=1):
            yield row_no, row
    else:
        raise DatasetError(f"{path}: unsupported dataset format '{suffix}'; use .jsonl or .parquet")


def _row_tools(row: dict) -> dict:
    """A row's tools (docs/agentic.md, "Data"): a flat `tools` list (names, or OpenAI-style schemas whose
    function name is taken) narrows the run's tools for this prompt; verl's `extra_info.tools_kwargs` ({tool name:
    arguments}) becomes the trajectory's initial tool state. Raises ValueError on a malformed entry."""
    out: dict = {}
    tools = row.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError(f"'tools' is a {type(tools).__name__}, expected a list of tool names or schemas")
        names = []
        for i, t in enumerate(tools, start=1):
            if isinstance(t, dict):
                from megatron_sortedrl.agentic.tools import schema_name

                try:
                    t = schema_name(t)
                except ValueError as exc:
                    raise ValueError(f"'tools' entry {i} is not a valid tool schema: {exc}") from None
            if not isinstance(t, str) or not t:
                raise ValueError(f"'tools' entry {i} is neither a tool name nor a schema with a function name")
            names.append(t)
        out["tools"] = names
    kwargs = _get(row, "extra_info.tools_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"'extra_info.tools_kwargs' is a {type(kwargs).__name__}, expected an object "
                             "{tool name: arguments}")
        for name, kw in kwargs.items():  # verl's {"create_kwargs": {...}} or the keyword dict itself
            inner = kw.get("create_kwargs", kw) if isinstance(kw, dict) else kw
            if inner is not None and not isinstance(inner, dict):
                raise ValueError(f"'extra_info.tools_kwargs.{name}' is {inner!r:.40}, expected an object of the "
                                 "tool's create arguments (or {\"create_kwargs\": {...}})")
        out["tools_kwargs"] = kwargs
    return out


class _BadRow:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _get(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_messages(messages: list, key: str) -> None:
    """A chat prompt: a non-empty list of mappings, each with a known `role` and a string `content` (what a
    chat template renders); raises ValueError naming the first bad message (1-based)."""
    if not messages:
        raise ValueError(f"'{key}' is an empty list of chat messages")
    for i, m in enumerate(messages, start=1):
        where = f"'{key}' message {i}"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is a {type(m).__name__}, expected a chat message {{\"role\", \"content\"}}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where} has role {role!r}, expected one of {', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            got = "no 'content'" if "content" not in m else f"a {type(m['content']).__name__} 'content'"
            raise ValueError(f"{where} ({role}) has {got}, expected a string 'content'")


def _to_prompt(row: Any, path: Path, row_no: int, prompt_key: str, answer_key: str) -> Prompt:
    if isinstance(row, _BadRow):
        raise ValueError(row.reason)
    if not isinstance(row, dict):
        raise ValueError(f"expected an object, got {type(row).__name__}")
    raw = _get(row, prompt_key)
    messages = None
    if isinstance(raw, list):
        check_messages(raw, prompt_key)
        messages = raw
        text = "\n".join(m["content"] for m in raw)
    elif isinstance(raw, str):
        text = raw
    elif raw is None:
        raise ValueError(f"no prompt at key '{prompt_key}' (keys present: {', '.join(sorted(row))})")
    else:
        raise ValueError(f"prompt at '{prompt_key}' is a {type(raw).__name__}, expected a string or chat messages")
    if not text.strip():
        raise ValueError(f"empty prompt at key '{prompt_key}'")
    truth = next((v for k in (answer_key, *GROUND_TRUTH_FALLBACKS) if (v := _get(row, k)) is not None), None)
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise ValueError(f"no ground truth at '{answer_key}' or {', '.join(GROUND_TRUTH_FALLBACKS)}")
    if isinstance(truth, (list, dict)):
        truth = json.dumps(truth)
    row_id = _get(row, "extra_info.index")
    if row_id is None:
        row_id = row.get("id")
    # Explicit ids and row numbers live in separate namespaces so they never collide.
    prompt_id = f"{path.stem}:{row_id}" if row_id is not None else f"{path.stem}:row{row_no}"
    meta = {"messages": messages} if messages else {}
    meta.update(_row_tools(row))
    return Prompt(prompt_id=prompt_id, text=text, ground_truth=str(truth), source=str(row.get("data_source", path.stem)),
                  meta=meta)
