"""`python -m megatron_sortedrl layout [config.yaml] [key=value ...]`: print the GPU placement, start nothing.

The dry run of a cluster recipe: validates the config (including the layout arithmetic against
`cluster.num_nodes x cluster.gpus_per_node`) and prints which node and GPUs every trainer rank and
rollout engine gets, for both rollout layouts.
"""

from __future__ import annotations

import argparse

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.layout import plan_layout

    cfg = config_from_args(args)
    if cfg.cluster.gpus_per_node == 0:
        print(f"{cfg.name}: CPU run (cluster.gpus_per_node=0): trainer world {cfg.parallel.world_size} processes, "
              f"{cfg.rollout.num_workers} rollout engines x TP {cfg.rollout.tensor_parallel_size}")
        return 0
    print(plan_layout(cfg).format())
    return 0
