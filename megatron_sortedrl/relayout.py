"""The driver's layout switch: executes the layout the planner chose for a round on the real engines.

    apply_layout(driver, rnd, row)           # Driver.compose_round, after the policy composed `rnd`
    apply_speculation(driver, rnd, row)      # then: plain or HistoSpec engines for the round, same layout

When the round's layout (`rnd.layout`, from `scheduler.layout_planner`, see scheduler/sim/layout_driver.py)
differs from the engines' (`RolloutPool.layout`), the pool stops every engine and starts the new ones
(`RolloutPool.set_layout`), which load the weights of the last sync again, so the new engines serve the
current policy version. Colocated, the switch goes through `Colocated.replace_engines`: the trainer's state
leaves the devices before the new engines start and size their KV cache, and they get the weights by a hand-off
once it is back. That is checked here: an engine that reports another version fails the run, since
its samples would carry a version they were not generated with. HistoSpec's drafters of the new engines
get the whole history again (`HistoryFeed.reset_engines`). `apply_speculation` rebuilds the engines in the same
layout when HistoSpec's round switch (`speculative.fast_path.RoundEngineSwitch`, pure logic) answers another
speculative config; it drives the pool, so it lives here on the driver's side, not in `speculative/`.

On the timeline the switch is a `relayout` phase (between the previous step and this round's rollout);
every rollout phase's start carries the layout it ran on (`layout`, e.g. "2xTP1"), which the run report's
rollout Gantt prints per step. The layout metrics go into the step's row: `rollout/layout_engines`,
`rollout/layout_tp`, `rollout/relayouts` (switches before this step's rounds), `time/relayout_s` (the
timeline's phase seconds), the round's `rollout/requests` and `rollout/predicted_longest`, and with the
`cost_model` planner its estimate of the round's time per candidate TP (`rollout/estimate_tp<N>_s`).

What a switch releases: the old engine actors and their vLLM processes (shut down, then killed), their
placement group, and the trainer->engines transfer groups: on GPU the stage senders destroy their NCCL
communicators before joining the new engines' groups at the next sync, the engines destroy theirs when
shut down, and the pool's single-sender `GpuWeightSync` is closed. So repeated switches keep one set of
engines and communicators alive (`tests/test_weight_sync_pipelined.py` on CPU: engine processes and the
run's memory stay flat over repeated switches; `tests/test_weight_sync_gpu.py` for the GPU memory).

Left out: switching while requests run (the pool refuses; a round's layout is chosen before it starts),
and keeping both layouts' engines resident to switch faster (vLLM sleep mode): each new engine builds its
KV cache again and, on GPU without `enforce_eager`, captures its CUDA graphs again; that is part of the
switch price (`cluster.relayout_s`), not a leak.
"""

from __future__ import annotations

from typing import Any

from speculative.fast_path import RoundEngineSwitch


def layout_name(num_engines: int, tp: int) -> str:
    """"2xTP1": engines x tensor-parallel size, as the timeline and the report print a layout."""
    return f"{num_engines}xTP{tp}"


def apply_layout(d: Any, rnd: Any, row: dict[str, float]) -> None:
    """Switches `d.pool` to `rnd.layout` if it differs (a `relayout` phase on the timeline); puts the layout
    metrics into the step's `row` (switches are counted over the step's rounds)."""
    want = (rnd.layout.num_engines, rnd.layout.tp)
    switched = want != tuple(d.pool.layout)
    if switched:
        before = layout_name(*d.pool.layout)
        d._phase("relayout", "start", layout=layout_name(*want))
        # Colocated: the trainer's state leaves before the new engines start (colocate/lifecycle.py)
        report = d.colo.replace_engines(lambda reload: d.pool.set_layout(*want, reload=reload))
        versions = sorted({w.version for w in d.pool.load()})
        if versions != [d.version]:
            raise RuntimeError(f"after the layout switch to {layout_name(*want)} the engines serve policy "
                               f"version(s) {versions}, not the current {d.version}")
        if d.cfg.speculative.enabled:
            d.feed.reset_engines()  # the new engines' drafters start empty
        d._phase("relayout", "end", layout=layout_name(*want))
        d.say(f"step {d.step}: layout {before} -> {layout_name(*want)} for round {rnd.index} ({rnd.kind}, "
              f"{len(rnd.requests)} requests) in {report['total_s']:.1f}s; engines at policy version {d.version}")
    predicted = [r.predicted_length for r in rnd.requests]
    row.update({"rollout/layout_engines": want[0], "rollout/layout_tp": want[1],
                "rollout/relayouts": row.get("rollout/relayouts", 0) + int(switched),
                "rollout/requests": len(predicted), "rollout/predicted_longest": max(predicted, default=0.0)})
    planner = d.policy.planner
    if getattr(planner, "candidates", None) and planner.model is not None and any(predicted):
        # What the cost_model planner compared (without the switch price): its estimate per candidate TP.
        prompt_len = sum(len(r.sample.prompt_tokens) for r in rnd.requests) / len(predicted)
        for tp in planner.candidates():
            engines = planner.layout(tp).num_engines
            row[f"rollout/estimate_tp{tp}_s"] = planner.model.estimate_round_s(tp, engines, predicted, prompt_len)


def apply_speculation(d: Any, rnd: Any, row: dict[str, float]) -> None:
    """Puts `d.pool` on the speculative config `rnd` needs (Driver.compose_round, after `apply_layout`): when
    it differs from the engines', they are rebuilt in the same layout, checked to serve the current policy
    version, and their drafters get the whole history. On the timeline
    it is a `relayout` phase (the same layout, rebuilt), as a layout switch is. Adds
    `rollout/speculative_engines` (1.0: HistoSpec engines, 0.0: plain) and `rollout/spec_switches` to `row`, and
    counts a rebuild in `rollout/relayouts`."""
    switch: RoundEngineSwitch | None = getattr(d.feed, "switch", None)
    if switch is None or not switch.active:
        return
    prompts = [(r.sample.prompt_tokens, r.sample.epoch) for r in rnd.requests]
    want = switch.config_for(prompts, d.history, d.pool.opts.speculative_config)
    switched = want != d.pool.opts.speculative_config
    if switched:
        kind, layout = "histospec" if want else "plain", layout_name(*d.pool.layout)
        d._phase("relayout", "start", layout=layout)
        d.pool.opts.speculative_config = want
        layout_now = tuple(d.pool.layout)  # colocated: the trainer's state leaves first (colocate/lifecycle.py)
        report = d.colo.replace_engines(lambda reload: d.pool.set_layout(*layout_now, reload=reload))
        versions = sorted({w.version for w in d.pool.load()})
        if versions != [d.version]:
            raise RuntimeError(f"after switching the engines to {kind} they serve policy version(s) {versions}, "
                               f"not the current {d.version}")
        d.feed.engines_replaced()
        d._phase("relayout", "end", layout=layout)
        d.say(f"step {d.step}: engines -> {kind} for round {rnd.index} ({len(rnd.requests)} requests, history "
              f"from an earlier epoch for {switch.history_share(prompts, d.history):.0%} of its "
              f"prompts) in {report['total_s']:.1f}s")
    # A rebuild is a relayout in the same layout: counted with the layout switches, so metrics and timeline agree.
    row.update({"rollout/speculative_engines": float(d.pool.opts.speculative_config is not None),
                "rollout/spec_switches": row.get("rollout/spec_switches", 0) + int(switched),
                "rollout/relayouts": row.get("rollout/relayouts", 0) + int(switched)})
