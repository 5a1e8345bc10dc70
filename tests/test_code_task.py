"""The code task: deterministic problems whose worked solutions pass their hidden tests in the sandbox,
lengths growing with difficulty, the task and its reward reachable from the config, and verl/DeepCoder
files scored by the same reward. CPU, about 10 s."""

from __future__ import annotations

import json
import random

from megatron_sortedrl.config import DataConfig
from megatron_sortedrl.data import load_prompts
from megatron_sortedrl.data.code_task import generate, make_problem, run_solution
from megatron_sortedrl.rewards import DEFAULT_REWARD, load_reward_fn
from megatron_sortedrl.rewards.code import reward
from megatron_sortedrl.sample import Sample


def test_same_seed_same_problems_and_tests_match_the_solution():
    a, b = generate(20, 7, 1, 5), generate(20, 7, 1, 5)
    assert [(p.prompt_id, p.text, p.ground_truth) for p in a] == [(p.prompt_id, p.text, p.ground_truth) for p in b]
    for p in a:
        truth = json.loads(p.ground_truth)
        assert truth["fn_name"] == "f" and len(truth["inputs"]) == 6
        assert run_solution(p.solution, [x for (x,) in truth["inputs"]]) == truth["outputs"]
        assert p.text.startswith("f(x): ") and len(p.text.split()) - 1 == p.difficulty


def test_solution_length_grows_with_difficulty():
    rng = random.Random(0)
    mean = {d: sum(len(make_problem(rng, d)[1]) for _ in range(50)) / 50 for d in (1, 3, 6)}
    assert mean[1] < mean[3] < mean[6] and mean[6] > 2 * mean[1]


def test_worked_solutions_score_one_and_broken_ones_zero_in_the_sandbox():
    prompts = generate(4, 3, 2, 4)
    for p in prompts:
        good = Sample(p.prompt_id, 0, response_text=p.solution, ground_truth=p.ground_truth)
        assert float(reward(good, p.ground_truth)) == 1.0
    p = prompts[0]
    broken = Sample(p.prompt_id, 1, response_text=p.solution.replace("return x", "return x + 1"))
    res = reward(broken, p.ground_truth)
    assert res.score == 0.0 and res.reason.startswith("wrong answer on test 1")


def test_task_and_default_reward_come_from_the_config():
    cfg = DataConfig(task="code", num_train_prompts=10, num_eval_prompts=4, max_difficulty=3)
    train, held = load_prompts(cfg, "train"), load_prompts(cfg, "eval")
    assert len(train) == 10 and len(held) == 4 and {p.source for p in train} == {"code"}
    assert DEFAULT_REWARD["code"] == "megatron_sortedrl.rewards.code.reward"
    assert load_reward_fn(DEFAULT_REWARD["code"]) is reward


def test_deepcoder_layout_file_is_loaded_and_scored(tmp_path):
    tests = [{"input": "3\n", "output": "9\n"}, {"input": "-2\n", "output": "4\n"}]
    row = {"prompt": [{"role": "user", "content": "Read n, print n squared."}], "data_source": "deepcoder",
           "reward_model": {"ground_truth": json.dumps(tests)}, "extra_info": {"index": 5}}
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (p,) = load_prompts(DataConfig(task="file", train_files=[str(path)]), "train")
    answer = "Here:\n```python\nn = int(input())\nprint(n * n)\n```\n"
    assert reward(Sample(p.prompt_id, 0, response_text=answer), p.ground_truth).score == 1.0
    wrong = "```python\nprint(int(input()) * 3)\n```"
    assert reward(Sample(p.prompt_id, 1, response_text=wrong), p.ground_truth).reason == "wrong answer on test 2 of 2"
