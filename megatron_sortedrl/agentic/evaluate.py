"""Held-out evaluation, with tools when the run has them: the driver's `evaluate` phase.

    samples = generate_eval(driver, prompts)                 # greedy; one finished Sample per prompt
    metrics = eval_metrics(scored_samples, with_tools=True)  # eval/accuracy, eval/response_len, eval/tools/*

Without tools it is one greedy engine request per prompt. With tools (`driver.agentic`) every prompt runs the
same turn loop as a rollout (agentic/trajectory.py `Trajectories`: a turn that calls a tool goes to the tool
runner, the tool messages are appended by the chat template and the trajectory continues as a new request with
the budget left) until a final answer, `tools.max_turns` or `rollout.max_response_length`; decoding is greedy in
every turn. So held-out accuracy on a tool task is measured with the tools, as RL trains it, and the reward
reads the final turn (`meta["trajectory"]`).

The eval's tool calls go through the run's one tool runner (its outcomes are keyed per submission, and no
rollout round is in flight while the driver evaluates).

Left out: sampled (pass@k) evaluation and evaluation on other engines than the rollout pool's.
"""

from __future__ import annotations

from typing import Any

from megatron_sortedrl.sample import Prompt, Sample


def generate_eval(d: Any, prompts: list[Prompt]) -> list[Sample]:
    """Greedy responses (trajectories with tools) to `prompts` on the rollout pool, one finished sample each."""
    from megatron_sortedrl.agentic.trajectory import sample_meta
    from megatron_sortedrl.rollout import GenRequest

    traj = getattr(d, "agentic", None)
    max_len = d.cfg.rollout.max_response_length
    workers = d.pool.layout[0]
    # epoch -1: ids (request ids and tool keys) that no training sample has
    made = [Sample(prompt_id=p.prompt_id, index=0, epoch=-1, prompt_tokens=list(d._tokens(p)),
                   ground_truth=p.ground_truth, meta=sample_meta(p)) for p in prompts]
    live = {s.sample_id: s for s in made}
    order = {sid: i for i, sid in enumerate(live)}  # a trajectory keeps its worker across turns

    def submit(samples: list[Sample]) -> None:
        if samples:
            d.pool.submit_many([(GenRequest(s.sample_id, s.prompt_tokens + s.response_tokens,
                                            d._sampling(max_len - s.response_length, greedy=True)),
                                 order[s.sample_id] % workers) for s in samples])

    done: list[Sample] = []
    submit(list(live.values()))
    while d.pool.in_flight or (traj is not None and traj.num_waiting):
        for c in d.pool.poll(0.05 if d.pool.in_flight else 0.0):
            s = live[c.request_id]
            c.to_sample(s)
            if traj is not None and c.finished and traj.turn_done(s):
                continue  # its calls went to the tools
            done.append(s)
        if traj is not None:
            again = []
            for s, more in traj.poll(0.0 if d.pool.in_flight else 0.05):
                (again if more else done).append(s)
            submit(again)
    for s in done:
        s.response_text = d.tok.decode(s.response_tokens, skip_special_tokens=True)
    return done


def eval_metrics(scored: list[Sample], with_tools: bool) -> dict[str, float]:
    """Accuracy (mean reward) and mean response length; with tools also the tool metrics of the trajectories
    (calls, errors, turns per trajectory, share of trajectories that called a tool) under `eval/tools/`."""
    n = max(1, len(scored))
    out = {"eval/accuracy": sum(s.reward or 0.0 for s in scored) / n,
           "eval/response_len": sum(s.response_length for s in scored) / n}
    if with_tools:
        from megatron_sortedrl.agentic.trajectory import step_metrics

        out.update({f"eval/{k}": v for k, v in step_metrics(scored).items() if not k.startswith("tools/seconds")})
    return out
