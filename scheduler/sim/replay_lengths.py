"""The recorded response lengths a replay workload plays back: a lengths JSON or a run timeline.

    from scheduler.sim.replay_lengths import load_lengths
    table = load_lengths("runs/x/timeline.jsonl")     # {prompt_id: {epoch: [lengths]}}

A JSON file is checked against `LENGTHS_SCHEMA` (a wrong structure is one line with the file and the JSON path);
a timeline gives the tokens of its request `finish` events, sample ids "<prompt>/e<epoch>/<index>". Both the
scenario loader (`sim_config.check_replay`, which reads the file when the scenario loads) and the replay workload
(`workload.ReplayWorkload`) read it, so it stands below both.

Left out: drawing from the table (the workload does that).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron_sortedrl.errors import UserError


LENGTHS_SCHEMA = {"type": "object", "minProperties": 1, "additionalProperties": {
    "type": "object", "minProperties": 1, "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}}


def load_lengths(path: str) -> dict[str, dict[int, list[int]]]:
    """{prompt_id: {epoch: [lengths]}} from a lengths JSON or a timeline's request finish events."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"workload.replay_path: {path} does not exist")
    if p.suffix == ".json":
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import best_match

        try:
            raw = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"workload.replay_path: {path} is not JSON ({exc})") from None
        problem = best_match(Draft202012Validator(LENGTHS_SCHEMA).iter_errors(raw))
        if problem is not None:
            raise UserError(f"workload.replay_path: {path} at {problem.json_path}: {problem.message[:160]}; expected "
                            '{prompt_id: {epoch: [lengths]}}, e.g. {"p0": {"0": [120, 87]}}')
        return {pid: {int(e): [int(x) for x in v] for e, v in per.items()} for pid, per in raw.items()}
    from megatron_sortedrl.telemetry.timeline import read_timeline

    table: dict[str, dict[int, list[int]]] = {}
    for e in read_timeline(p):
        if e.kind == "request" and e.event == "finish" and e.sample_id and e.tokens is not None:
            m = re.fullmatch(r"(.+)/e(\d+)/(\d+)", e.sample_id)
            pid, epoch = (m.group(1), int(m.group(2))) if m else (e.sample_id.rsplit("/", 1)[0], 0)
            table.setdefault(pid, {}).setdefault(epoch, []).append(e.tokens)
    if not table:
        raise UserError(f"workload.replay_path: {path} holds no request finish events with tokens")
    return table
