"""The driver's phase bookkeeping: when the data is used up, the rollout phase that found nothing to generate
is closed at once, so the run's last phase does not stretch over the final evaluation (any tool that pairs
phase starts and ends, e.g. the report's phase bars or a calibration, would otherwise charge the eval to
rollout). Uses the real `Driver.compose_round` and timeline writer on a driver without engines."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_sortedrl.driver import Driver
from megatron_sortedrl.telemetry.timeline import TimelineWriter, phase_intervals, read_timeline


class _NoRewards:
    def poll(self):
        return []

    def drain(self):
        return []

    def __len__(self) -> int:
        return 0


class _UsedUp:
    """A policy whose data is used up: it composes no round."""

    def compose_round(self, clock):
        return None


def test_exhausted_rollout_phase_is_closed(tmp_path):
    writer = TimelineWriter(tmp_path / "timeline.jsonl")
    d = SimpleNamespace(events=[], step=7, timeline=writer, rewards=_NoRewards(), policy=_UsedUp(), clock=writer.clock,
                        pool=SimpleNamespace(layout=(1, 1)), layout_row={})
    d._phase = lambda name, event, **fields: Driver._phase(d, name, event, **fields)
    assert Driver.compose_round(d) is None
    d.step = 6  # the driver steps back; the final eval is charged to the last trained step
    Driver._phase(d, "eval", "start")
    Driver._phase(d, "eval", "end")
    writer.close()
    spans = phase_intervals(read_timeline(tmp_path / "timeline.jsonl"))
    rollout = [(a, b) for step, phase, a, b in spans if phase == "rollout"]
    eval_start = min(a for _, phase, a, _ in spans if phase == "eval")
    assert len(rollout) == 1 and rollout[0][1] <= eval_start
