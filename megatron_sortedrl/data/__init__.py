"""Prompts for training and evaluation: procedural tasks and local jsonl/parquet datasets.

`load_prompts(cfg.data, split)` is the one entry point the driver uses; it returns `Prompt` records.
"""

from megatron_sortedrl.data.loaders import load_prompts

__all__ = ["load_prompts"]
