"""Megatron-core policy trainer: model from a HF config, HF weight table, log-probs, RL step, checkpoints.

The driver uses `TrainerGroup` (group.py); everything else is per-rank machinery. See docs/trainer.md.
"""
