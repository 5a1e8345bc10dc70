"""Hugging Face <-> Megatron torch_dist checkpoint conversion (see `core.py`, docs/conversion.md)."""
