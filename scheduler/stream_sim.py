"""Stream training in the simulator, colocated placement: training on the GPUs the round's tail leaves idle.

    simulate(sim, run, "twotier+histospec")   with cluster.stream_training=true in the scenario

RollPacker's stream trainer, as the driver runs it (`trainer.stream`): the backward of a finished prompt
group that the harvest will train starts while the rest of the round generates, accumulating into the one
optimizer step at harvest (the update equals the batch update: tests/test_trainer_stream.py). Colocated, the
trainer can only use GPUs no engine needs: an engine's GPUs are free from the moment it has no request left
in the round (its last finish) until the harvest. Model, per round:

- free GPUs at time t: the TP of every engine idle since before t (`SimEngine.idle_since`);
- trainable tokens at time t: prompt + response tokens of the update's samples finished (reward included)
  by t. The update's samples are known only at harvest, but every one of them was certain to be trained
  when it finished (twotier trains every due prompt and the earliest-complete others; sync trains all), so
  using them is no hindsight for those policies;
- tokens are trained at `train_tokens_per_s * free / gpus` (the cluster's rate, shared linearly), never
  ahead of what has finished; what is left trains after the harvest on all GPUs, then the step and sync.

The physical limit stays a lower bound: it charges generation and training as GPU time on the same GPUs,
and linear sharing gives training no more than its cluster rate per GPU.

Left out: the disaggregated placement (trainer GPUs of their own; would need its own limit), the time to
offload an idle engine's weights and KV cache before training on its GPUs, and lookahead work competing for
the same idle GPUs (an engine running lookahead requests is not idle, so it does not train).
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


def stream_round(sim: Any, batch: list, t_end: float) -> float:
    """Tokens of `batch` the simulator's idle engines trained during the round that ended at `t_end` (a sample is
    ready once its reward is in: its finish time plus the reward latency)."""
    c = sim.sim.cluster
    idle = [(e.idle_since, e.tp) for e in sim.engines if e.idle_since is not None]
    finished = [((s.finish_time or t_end) + c.reward_latency_s, len(s.prompt_tokens) + s.response_length)
                for s in batch]
    return streamed_tokens(idle, finished, t_end, c.gpus, c.train_tokens_per_s)
