"""Multi-turn, tool-using rollouts (trajectories): the tool interface, call parsing, tool execution off the
engines, and the trajectory record the trainer sees (docs/agentic.md)."""
