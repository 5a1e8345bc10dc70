"""`python -m megatron_sortedrl layout [config.yaml] [key=value ...]`: print the GPU placement, start nothing.

The dry run of a cluster recipe: validates the config (including the layout arithmetic against
`cluster.num_nodes x cluster.gpus_per_node`) and prints which node and GPUs every trainer rank and
rollout engine gets, for both rollout layouts. `--ray-resources` prints only "CPUS GPUS IFNAME" per node
from `cluster.cpus_per_node`, `cluster.gpus_per_node` (0: not set) and `cluster.socket_ifname` (-: not set),
which slurm/ray_on_slurm.sh turns into what each node's srun step asks for and the sockets' interface.
"""

from __future__ import annotations

import argparse

from megatron_sortedrl.cli import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-resources", action="store_true",
                        help="print 'CPUS GPUS IFNAME' per node (cluster.cpus_per_node, cluster.gpus_per_node, "
                             "cluster.socket_ifname or -) and exit")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.layout import plan_layout

    cfg = config_from_args(args)
    if args.ray_resources:
        print(cfg.cluster.cpus_per_node, cfg.cluster.gpus_per_node, cfg.cluster.socket_ifname or "-")
        return 0
    if cfg.cluster.gpus_per_node == 0:
        print(f"{cfg.name}: CPU run (cluster.gpus_per_node=0): trainer world {cfg.parallel.world_size} processes, "
              f"{cfg.rollout.num_workers} rollout engines x TP {cfg.rollout.tensor_parallel_size}")
        return 0
    print(plan_layout(cfg).format())
    return 0
