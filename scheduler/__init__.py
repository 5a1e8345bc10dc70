"""Length-aware two-tier rollout scheduling: history, tier-1 round policies, tier-2 placement; the simulator in sim/.

The policies here are pure logic driven by events and a clock interface, so the real RL loop and the
discrete-event simulator (`scheduler/sim/`, a layer above them) run the same objects. Nothing here imports an
engine, and nothing here imports the simulator.
"""
