"""`python -m megatron_sortedrl ray-check [config.yaml] [key=value ...] [--address A] [--expect-nodes N]`.

Waits until a Ray cluster has N alive nodes (default: cluster.num_nodes of the config) and prints each
node with its resources. Used by the Slurm bring-up (slurm/ray_on_slurm.sh) before the driver starts;
on timeout it names the nodes that did not join and exits 2.
"""

from __future__ import annotations

import argparse
import time

from megatron_sortedrl.cli import add_config_arguments, config_from_args
from megatron_sortedrl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--address", default=None, help="Ray address host:port (default: cluster.ray_address)")
    parser.add_argument("--expect-nodes", type=int, default=None, help="nodes that must join (default: cluster.num_nodes)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the nodes")
    parser.add_argument("--node-names", nargs="*", default=[], help="expected host names, to name missing nodes")


def run(args: argparse.Namespace) -> int:
    import ray

    cfg = config_from_args(args)
    address = args.address or cfg.cluster.ray_address
    if not address:
        raise UserError("no Ray address: pass --address host:port or set cluster.ray_address")
    expect = args.expect_nodes or cfg.cluster.num_nodes
    deadline = time.monotonic() + args.timeout
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= expect or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for node in alive:
            res = node.get("Resources", {})
            print(f"node {node.get('NodeManagerHostname')} ({node.get('NodeManagerAddress')}): "
                  f"{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs, "
                  f"{res.get('memory', 0) / 2**30:.2f} GiB memory")
        if len(alive) < expect:
            joined = {n.get("NodeManagerHostname") for n in alive} | {n.get("NodeManagerAddress") for n in alive}
            missing = [name for name in args.node_names if name not in joined] or ["(names unknown)"]
            raise UserError(f"only {len(alive)} of {expect} nodes joined the Ray cluster at {address} within "
                            f"{args.timeout:g}s; not joined: {', '.join(missing)} (check those nodes' Slurm output)")
        print(f"ray cluster at {address}: {len(alive)} nodes joined")
    finally:
        ray.shutdown()
    return 0
