"""The end of a Ray head that a benchmark started itself (`ray start --head --block`): stop it, and forget it.

    from benchmarks.ray_head import stop_ray_head
    stop_ray_head(proc, "127.0.0.1:6379")

`ray start` writes the head's address to Ray's bootstrap file (`/tmp/ray/ray_current_cluster`). Ending the
blocking process stops the head's processes but leaves that file, and every later `ray.init()` without an
address on the machine then tries to join the dead head and waits for its GCS indefinitely (seen: a test suite
run after a benchmark hung there). So the file goes too, when it still names this head (the same port: Ray
writes the node's own IP there, not the 127.0.0.1 given to `ray start`). Never `ray stop`: other clusters may
share the machine.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def stop_ray_head(proc: subprocess.Popen, address: str, timeout: float = 120.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        if path.read_text().strip().rsplit(":", 1)[-1] == address.rsplit(":", 1)[-1]:
            path.unlink()
    except FileNotFoundError:
        pass
