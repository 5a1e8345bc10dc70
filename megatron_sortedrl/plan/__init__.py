"""Launch planning: what a recipe needs per GPU, per engine and per node, computed before anything starts.

    python -m megatron_sortedrl plan configs/qwen32b_128gpu.yaml --model-config configs/model_shapes/qwen2.5-32b-instruct
    from megatron_sortedrl.plan.trainer_memory import trainer_memory

Modules: `arch` (model shapes from a config.json, dense and Mixture-of-Experts), `trainer_memory` (trainer
bytes per GPU and stage; its MoE terms in `moe_memory`: experts per EP rank, router, dispatch buffers),
`engine` (rollout engine weights, KV cache, weight-sync estimate), `colocated` (`cluster.colocate`: memory per
GPU in the rollout, switch and update phases, offloaded state per node, switch seconds), `planner` (the whole
plan with host memory per node, the fit checks `train` runs at start, recompute `auto`). See docs/scaling.md.

The trainer-memory model (`trainer_memory.py`) is checked against bytes measured on CPU
(`measure_activations.py`, `benchmarks/plan_vs_measured.py`) and against Megatron-LM's own theoretical
accounting (docs/benchmarks/plan_vs_megatron.md). The planning modules do pure arithmetic on a model's
config.json (no torch, no GPU, no weights); only the measurement helper runs Megatron.
"""
