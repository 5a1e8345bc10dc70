"""benchmarks/run_log.py: a benchmark restarted on its work directory skips finished runs and its summary
names the first start's command and the seconds of every start."""

from __future__ import annotations

import json

from benchmarks.run_log import RunLog


def test_runs_survive_a_restart_and_the_first_command_is_kept(tmp_path):
    first = RunLog(tmp_path, key=("variant", "repeat"), command="python b.py --repeats 3")
    first.add({"variant": "sync", "repeat": 0, "x": 1.5})
    first.add({"variant": "twotier", "repeat": 0, "x": 2.5})
    first.finish()  # e.g. killed after two runs; the next start goes on

    again = RunLog(tmp_path, key=("variant", "repeat"), command="python b.py --repeats 3 --reading r.md")
    assert ("sync", 0) in again and ("twotier", 0) in again and ("sync", 1) not in again
    assert again[("twotier", 0)]["x"] == 2.5 and len(again) == 2
    again.add({"variant": "sync", "repeat": 1, "x": 3.5})
    assert len(again.setup()["starts"]) == 2  # this start, still open, counts
    again.finish()
    again.finish()
    setup = again.setup()
    assert setup["command"] == "python b.py --repeats 3"  # not the summary-only start's
    assert [s["command"] for s in setup["starts"]] == ["python b.py --repeats 3", "python b.py --repeats 3 --reading r.md"]
    assert [s["runs_after"] for s in setup["starts"]] == [2, 3]
    assert setup["benchmark_s"] == round(sum(s["seconds"] for s in setup["starts"]), 1)
    lines = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["repeat"]) for r in lines] == [("sync", 0), ("twotier", 0), ("sync", 1)]


def test_a_later_record_of_the_same_key_wins(tmp_path):
    log = RunLog(tmp_path, key=("variant", "dtype", "repeat"))
    log.add({"variant": "moe", "dtype": "bfloat16", "repeat": 0, "v": 1})
    log.add({"variant": "moe", "dtype": "bfloat16", "repeat": 0, "v": 2})
    assert RunLog(tmp_path, key=("variant", "dtype", "repeat"))[("moe", "bfloat16", 0)]["v"] == 2
