"""Tail migration in the simulator: an engine that has run dry takes over a running request of the busiest engine.

    cluster.tail_migration: true   in a simulator scenario (configs/sim_*.yaml)
    from scheduler.sim.tail_migration import take_running

When an engine has nothing left to run (no queued request of the round, no lookahead request), it would idle
until the harvest while other engines still decode many sequences each, each step slowed by the others'
weights-and-KV reads and per-sequence compute. The driver can move such a request with what it already has for
partial rollouts: abort it on the busy engine (the engine hands back its tokens, as at a harvest) and resubmit
it, tokens included, to the idle engine, which re-prefills prompt + response and decodes on. Model:

- the idle engine takes one request from the engine with the most running sequences, if that engine runs at
  least two (a lone sequence is never moved: that would only move the idle time);
- the request moved is the one with the most predicted tokens left (`Request.predicted_length` minus what it
  has generated: only what the driver knows, not the simulator's drawn length);
- the busy engine drops it at the end of the step it is running; the idle engine starts it no earlier than
  that, paying the re-prefill of its whole context (the simulator's `admit` charges it), with the request's
  speculation rate unchanged (its drafter history is the same);
- the timeline shows an `abort` on the old worker and a `submit` on the new one, so the bubble ratios are
  computed exactly as for any request (a moved request keeps its new engine busy, the old one loses it).

Written here rather than taken from a library: it acts on the simulator's own engine objects.
Left out: moving KV over the network instead of recomputing it, and a transfer latency beyond the step end.
"""

from __future__ import annotations

from typing import Any


def take_running(sim: Any, thief: Any) -> Any | None:
    """Moves one running sequence from the busiest other engine onto `thief` (returns it), or None."""
    donors = [e for e in sim.engines if e is not thief and len(e.running) >= 2]
    if not donors:
        return None
    donor = max(donors, key=lambda e: (len(e.running), -e.wid))
    donor.advance_to(max(sim.clock.t, thief.t), finish_step=True)  # the step it is running ends first
    if len(donor.running) < 2:
        return None
    seq = max(donor.running, key=lambda s: s.req.predicted_length - s.gen)
    donor.running.remove(seq)
    donor.ctx -= seq.context
    sid = seq.req.sample.sample_id
    sim.emit("request", "abort", donor.t, worker=donor.wid, sample_id=sid, tokens=int(seq.gen))
    sim.migrations += 1
    donor.plan()  # its next chunk runs without the moved sequence
    thief.t = max(thief.t, donor.t)
    sim.where[sid] = thief
    sim.emit("request", "submit", thief.t, worker=thief.wid, sample_id=sid, tokens=int(seq.gen))
    return seq
