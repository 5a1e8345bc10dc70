"""The launch planner: what a recipe needs per GPU, per engine and per node, checked before anything starts.

    python -m megatron_sortedrl plan configs/qwen32b_128gpu.yaml --model-config configs/model_shapes/qwen2.5-32b

Modules: `arch` (model shapes from a config.json), `trainer_memory` (trainer bytes per GPU and stage),
`engine` (rollout engine weights and KV cache), `sync` (weight-sync bytes and time), `host` (host memory
per node), `planner` (the whole plan, the fit checks, recompute `auto`). See docs/scaling.md.
"""
