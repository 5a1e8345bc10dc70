"""Colocated layout (`cluster.colocate: true`): trainer ranks and rollout engines take turns on the same devices.

    from megatron_sortedrl.colocate import start_engines
    pool, colo = start_engines(cfg, trainer, PoolOptions.from_config(cfg), say)   # driver set-up
    colo.attach(driver._phase)      # from here on every transition is a timeline phase with its bytes
    colo.to_rollout(); ...generate...; colo.to_train(); ...train...; colo.hand_off(version)

`lifecycle.py` is the state machine the driver calls once per transition (one phase each: `wake`, `offload`,
`sleep`, `reload`, `handoff`); `engines.py` sleeps and wakes the pool's engines. A disaggregated run gets the
same object with nothing to do (`Disaggregated`), so the driver has one code path. The scheduler's behaviour on
a colocated layout, the config keys and the timeline are described in docs/cluster.md, "Colocated".

Left out: stream training on colocated devices (refused at config load: the trainer cannot run a backward on
devices the engines hold), and shrinking engines that hand their devices to the trainer in a round's tail.
"""

from megatron_sortedrl.colocate.lifecycle import Colocated, Disaggregated, start_engines

__all__ = ["Colocated", "Disaggregated", "start_engines"]
