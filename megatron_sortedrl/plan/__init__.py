"""Launch planning: what a recipe needs per GPU, per engine and per node, computed before anything starts.

    from megatron_sortedrl.plan.trainer_memory import trainer_memory
    python -m megatron_sortedrl plan configs/qwen32b_128gpu.yaml --model-config configs/model_shapes/qwen2.5-32b-instruct

The trainer-memory model (`trainer_memory.py`) is checked against bytes measured on CPU
(`measure_activations.py`, `benchmarks/plan_vs_measured.py`) and against Megatron-LM's own theoretical
accounting (docs/benchmarks/plan_vs_megatron.md). The planning modules do pure arithmetic on a model's
config.json (no torch, no GPU, no weights); only the measurement helper runs Megatron.
"""
