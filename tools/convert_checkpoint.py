"""Checkpoint conversion script: the same as `python -m megatron_sortedrl convert ...`.

    python tools/convert_checkpoint.py hf-to-mcore --hf <dir> --out <dir> --tp 2 --pp 2 [--verify]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt <dir> --out <dir> [--hf-config <dir>] [--verify]
"""

import sys

from megatron_sortedrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
