#!/usr/bin/env python
"""Write the built-in tiny Qwen2 model as a Hugging Face directory.

    python tools/build_tiny_model.py --out runs/tiny_model [configs/tiny_cpu.yaml] [model.tiny.num_layers=4]

Same as `python -m megatron_sortedrl build-tiny-model`.
"""

import sys

from megatron_sortedrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-tiny-model", *sys.argv[1:]]))
