#!/usr/bin/env bash
# This node's IPv4 address for Ray's head (GCS) and every node's join, run on the head inside an srun step
# (slurm/ray_on_slurm.sh):
#
#   srun ... -w <head> bash slurm/node_address.sh [interface]
#
# - With an interface (cluster.socket_ifname, the one gloo and NCCL use): that interface's first IPv4 address;
#   none is one line naming the interface, exit 2.
# - Without: the first address `hostname -I` lists (the host's configured addresses, loopback excluded).
#   `hostname --ip-address` resolves the host name instead, which is 127.0.1.1 on hosts whose /etc/hosts maps
#   the name to loopback (Debian and Ubuntu do) and an arbitrary interface elsewhere: other nodes cannot reach
#   a loopback head, so a loopback answer is refused in one line.
# Left out: IPv6-only clusters (Ray's head takes an IPv4 address here).
set -euo pipefail

ifname=${1:-}
if [[ -n "$ifname" ]]; then
    addr=$(ip -o -4 addr show dev "$ifname" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
    if [[ -z "$addr" ]]; then
        echo "ray_on_slurm: $(hostname): interface $ifname (cluster.socket_ifname) has no IPv4 address" >&2
        exit 2
    fi
else
    addr=$(hostname -I 2>/dev/null | tr ' ' '\n' | awk '/^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$/ && !/^127\./ {print; exit}')
    if [[ -z "$addr" ]]; then
        echo "ray_on_slurm: $(hostname): no non-loopback IPv4 address (hostname -I); set cluster.socket_ifname" \
            "or MSRL_HEAD_IP" >&2
        exit 2
    fi
fi
echo "$addr"
