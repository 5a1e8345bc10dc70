"""Stream training in the simulator, both placements: colocated (training on the GPUs the round's tail leaves
idle) and disaggregated (trainer GPUs of their own, `cluster.trainer_gpus`).

    simulate(sim, run, "twotier+histospec")   with cluster.stream_training=true (and cluster.trainer_gpus=N) in the scenario

RollPacker's stream trainer, as the driver runs it (`trainer.stream`): the backward of a finished prompt
group that the harvest will train starts while the rest of the round generates, accumulating into the one
optimizer step at harvest (the update equals the batch update: tests/test_trainer_stream.py). Model, per round:

- **colocated**: the trainer can only use GPUs no engine needs: an engine's GPUs are free from the moment it has
  no request left in the round (`SimEngine.idle_since`, its last finish) until the harvest;
- **disaggregated**: `trainer_gpus` GPUs train and never generate (the engines get the other GPUs); they are free
  for the whole rollout phase, from its start. Without `stream_training` they wait for the harvest, then train
  the whole batch, so the placement is then only slower than colocated (fewer engines, a slower trainer);
- trainable tokens at time t: prompt + response tokens of the update's samples finished (reward included)
  by t. The update's samples are known only at harvest, but every one of them was certain to be trained
  when it finished (twotier trains every prompt complete at the cut; sync trains all), so
  using them is no hindsight for those policies;
- tokens are trained at `train_tokens_per_s * free / gpus` (the cluster's rate, shared linearly over GPUs),
  never ahead of what has finished; what is left trains after the harvest on the trainer's GPUs (all of them
  colocated, `trainer_gpus` disaggregated), then the step's fixed cost and the weight sync. Rounds stay
  synchronous (the next round starts after the sync), so staleness is what the policy makes it.

The physical limit stays a lower bound: colocated, it charges generation and training as GPU time on the same
GPUs; disaggregated, generation and token training overlap, so the bound for that placement is the GPU-time one
(`scheduler/sim/limit.py`, `any_placement_s_per_sample`); linear sharing gives training no more than its cluster rate
per GPU in both.

Left out: the time to offload an idle engine's weights and KV cache before training on its GPUs (colocated),
the transfer of finished samples to separate trainer GPUs (disaggregated), and lookahead work competing for the
same idle GPUs (an engine running lookahead requests is not idle, so it does not train).
"""

from __future__ import annotations

from typing import Any, Iterable


def streamed_tokens(idle_since: Iterable[tuple[float, int]], finished: Iterable[tuple[float, int]], t_end: float,
                    gpus: int, tokens_per_s: float) -> float:
    """Tokens trained before `t_end` on idle GPUs. `idle_since`: (time an engine went idle for the rest of the
    round, its GPUs); `finished`: (time a trained sample was ready, its tokens)."""
    points = sorted({t for t, _ in idle_since if t < t_end} | {t for t, _ in finished if t < t_end} | {t_end})
    idle = sorted((t, g) for t, g in idle_since if t < t_end)
    ready = sorted((t, n) for t, n in finished if t < t_end)
    done = avail = 0.0
    free = 0
    i = j = 0
    prev = points[0] if points else t_end
    for t in points:
        # Between prev and t: `free` GPUs train, capped by what had finished by prev (tokens finishing inside
        # the interval wait for its end: a small under-estimate, never an over-estimate).
        done = min(avail, done + free * tokens_per_s / gpus * (t - prev))
        while i < len(idle) and idle[i][0] <= t:
            free += idle[i][1]
            i += 1
        while j < len(ready) and ready[j][0] <= t:
            avail += ready[j][1]
            j += 1
        prev = t
    return done


def stream_round(sim: Any, batch: list, t0: float, t_end: float) -> float:
    """Tokens of `batch` trained during the round [t0, t_end] (a sample is ready once its reward is in: its finish
    time plus the reward latency): on the idle engines' GPUs (colocated) or on the trainer's own from t0."""
    c = sim.sim.cluster
    if c.trainer_gpus:
        idle = [(t0, c.trainer_gpus)]
    else:
        idle = [(e.idle_since, e.tp) for e in sim.engines if e.idle_since is not None]
    finished = [((s.finish_time or t_end) + c.reward_latency_s, len(s.prompt_tokens) + s.response_length)
                for s in batch]
    return streamed_tokens(idle, finished, t_end, c.gpus, c.train_tokens_per_s)


def train_phase_s(sim: Any, batch: list, t0: float, t_end: float, tokens: float, steps: int = 1, epochs: int = 1,
                  stream_cap: float | None = None) -> tuple[float, float]:
    """(seconds of the train phase after the harvest at `t_end`, tokens streamed before it) for an update of `batch`
    (`tokens` prompt + response tokens trained) whose round started at `t0`, in `steps` optimizer steps over
    `epochs` passes (`megatron_sortedrl/minibatch.py`): the fixed cost once, each step's own, every token once per
    epoch. With several mini-batches only the first one's tokens can be streamed (`stream_cap`): the later ones
    need the weights after the steps before them."""
    c = sim.sim.cluster
    streamed = stream_round(sim, batch, t0, t_end) if c.stream_training else 0.0
    if stream_cap is not None:
        streamed = min(streamed, stream_cap)
    rate = c.train_tokens_per_s * (c.trainer_gpus / c.gpus if c.trainer_gpus else 1.0)
    return c.train_fixed_s + steps * c.optimizer_step_s + max(0.0, tokens * epochs - streamed) / rate, streamed
