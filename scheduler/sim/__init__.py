"""The discrete-event cluster simulator: a layer above the scheduling policies that runs them on simulated engines.

    python -m megatron_sortedrl simulate configs/sim_qwen32b_128gpu.yaml --policies sync,twotier
    from scheduler.sim.simulator import simulate

It simulates a whole run, so it may read the run config, the timeline format and the data loaders; it imports
the policies (`scheduler/*.py`), and nothing in `scheduler/` or `speculative/` below it imports it
(tests/test_architecture.py checks both).
"""
