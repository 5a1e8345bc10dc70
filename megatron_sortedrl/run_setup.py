"""The driver's set-up: everything a run starts before its first phase, in the order it has to start.

    set_up_run(driver, reward_fn)     # Driver.__init__, after preflight; a failure ends what it started

Tokenizer and prompts (encoded once, over-long ones skipped and listed), one Ray instance for trainer ranks and
engines, the trainer group, the rollout engines (plain while HistoSpec has no history; colocated ones share the
trainer's devices), the reward stage, the scheduling policy with its layout planner, the streamed trainer, the
HistoSpec feed and the mini-batcher. Each lands as an attribute of the driver, which then runs the phases
(`driver.py`). Split out of the driver so that file stays the loop.

Left out: resuming (the driver loads its checkpoint after this) and the record files (`run_records.py`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from megatron_sortedrl.agentic.trajectory import trajectories_for
from megatron_sortedrl.minibatch import MiniBatcher
from megatron_sortedrl.placement import local_ray_env, socket_env
from megatron_sortedrl.reward_stage import make_reward_stage
from megatron_sortedrl.shaping import shape_batch
from speculative.fast_path import initial_speculative_config


def set_up_run(d: Any, reward_fn: Any = None) -> None:
    """Starts what the run `d` (a `Driver`) needs and sets it on `d`: tok, eos, agentic, encoder, prompts,
    eval_prompts, owns_ray, trainer, pool, colo, rewards, policy, stream, feed, history, minibatch."""
    import ray
    from transformers import AutoTokenizer

    from megatron_sortedrl.data import load_prompts
    from megatron_sortedrl.data.prompting import PromptEncoder
    from megatron_sortedrl.colocate import start_engines
    from megatron_sortedrl.rollout import PoolOptions
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.trainer.group import TrainerGroup
    from megatron_sortedrl.trainer.stream import DriverStream
    from scheduler.sim.layout_driver import driver_planner
    from scheduler.policies import make_policy
    from speculative.feed import HistoryFeed

    cfg = d.cfg
    random.seed(cfg.seed)
    if not Path(cfg.model.path).exists() and cfg.model.build_tiny_if_missing:
        build_tiny_model(cfg.model.path, cfg.model.tiny)
        d.say(f"built tiny model at {cfg.model.path}")
    d.tok = AutoTokenizer.from_pretrained(cfg.model.path)
    d.eos = d.tok.eos_token_id
    # multi-turn tool use: the turn loop and its tool runner, None without tools (agentic/trajectory.py)
    d.agentic = trajectories_for(cfg, d.tok, d.tool_event)
    d.encoder = PromptEncoder(d.tok, cfg.data, d.agentic.schemas if d.agentic is not None else None)
    (d.run_dir / "skipped_prompts.jsonl").unlink(missing_ok=True)  # written anew at every start
    d.prompts = {p.prompt_id: p for p in d.encode_prompts(load_prompts(cfg.data, "train"))}
    d.eval_prompts = d.encode_prompts(load_prompts(cfg.data, "eval"))
    # One Ray instance for trainer ranks and engines; without this the trainer would size it to itself.
    # Without cluster.ray_address it is a new local instance ("local"): Ray would otherwise attach to any
    # other Ray running on this machine (another user's run, a test) and share its CPUs.
    if not ray.is_initialized():
        need = cfg.parallel.world_size + cfg.rollout.num_workers * cfg.rollout.tensor_parallel_size
        os.environ.update(local_ray_env(cfg.cluster))  # (worker niceness: read by the raylet ray.init starts)
        sockets = socket_env(cfg.cluster)  # gloo/NCCL interface for every rank and engine
        os.environ.update(sockets)
        ray.init(address=cfg.cluster.ray_address or "local", include_dashboard=False, log_to_driver=False,
                 num_cpus=None if cfg.cluster.ray_address else max(need, os.cpu_count() or 1),
                 runtime_env={"env_vars": sockets} if sockets else None)
        d.owns_ray = True
    else:
        d.owns_ray = False
    d.say("starting trainer group ...")
    d.trainer = TrainerGroup(cfg)
    d.say("starting rollout pool ...")
    # HistoSpec's round switch starts the engines plain while no prompt has history (speculative/fast_path.py).
    spec = initial_speculative_config(cfg.speculative)
    # colocate/: a colocated run's engines share the trainer's devices; `colo` makes each switch a phase
    d.pool, d.colo = start_engines(cfg, d.trainer, PoolOptions.from_config(cfg, speculative_config=spec), d.say)
    d.rewards = make_reward_stage(cfg, reward_fn, d.say)  # scaling, timeouts, critical path
    planner = driver_planner(cfg)  # scheduler.layout_planner (scheduler/sim/layout_driver.py)
    d.policy = make_policy(cfg.scheduler, sorted(d.prompts), n_samples=cfg.rollout.n_samples_per_prompt,
                           max_response_length=cfg.rollout.max_response_length, planner=planner,
                           seed=cfg.seed, sample_factory=d.new_sample,
                           num_epochs=cfg.data.num_epochs or None, sampling=cfg.sampling,
                           mini_batch=cfg.algorithm.ppo_mini_batch_size or cfg.scheduler.update_batch_size)
    if d.agentic is not None:  # the history predicts trajectory cost: tokens, turns, tool seconds
        d.agentic.attach(d.policy)
    # trainer/stream.py; a streamed group gets the batch's overlong shaping before its advantages
    d.stream = DriverStream(d.trainer, d.policy, lambda g: shape_batch(
        g, cfg.sampling, cfg.rollout.max_response_length)[0]) if cfg.trainer.stream else None
    # HistoSpec: records, ships, measures (speculative/feed.py); with tools its drafts align turns by the marker
    marker = d.agentic.renderer.turn_marker() if d.agentic is not None else []
    d.feed = HistoryFeed(cfg.speculative, d.pool, turn_marker=marker)
    d.history = d.feed.store
    # mini-batches of every harvest; the remainder waits for the next one (minibatch.py)
    d.minibatch = MiniBatcher(cfg.algorithm.ppo_mini_batch_size, cfg.algorithm.ppo_epochs)
