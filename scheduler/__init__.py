"""Length-aware two-tier rollout scheduling: history, tier-1 round policies, tier-2 placement, simulator.

Pure logic driven by events and a clock interface, so the real RL loop and the discrete-event
simulator run the same objects. Nothing here imports an engine.
"""
