"""`python -m megatron_sortedrl convert {hf-to-mcore,mcore-to-hf} ...`: checkpoint conversion on CPU.

    python -m megatron_sortedrl convert hf-to-mcore --hf models/qwen --out ckpt/qwen_tp2pp2 --tp 2 --pp 2 --verify
    python -m megatron_sortedrl convert mcore-to-hf --ckpt runs/x/checkpoints/iter_0000100 --out out/hf \
        --hf-config models/qwen --verify

Bad inputs (unsupported architecture, truncated or missing shards, missing index entries, a TP that does
not divide heads and query groups, a --hf-config that does not describe the checkpoint) print one `error:`
line and exit 2 before anything is written.
The work is in `megatron_sortedrl/convert/core.py`.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="<direction>", required=True)
    a = sub.add_parser("hf-to-mcore", help="Hugging Face dir -> Megatron torch_dist checkpoint (model only)")
    a.add_argument("--hf", required=True, help="Hugging Face model directory (safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to write")
    a.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    a.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    a.add_argument("--ep", type=int, default=1, help="MoE: target expert-parallel size (must divide the experts)")
    a.add_argument("--etp", type=int, default=None, help="MoE: target expert tensor-parallel size (default: --tp)")
    a.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: config.json's)")
    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> Hugging Face dir (sharded safetensors)")
    b.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (complete, torch_dist)")
    b.add_argument("--out", required=True, help="Hugging Face directory to write")
    b.add_argument("--hf-config", default=None,
                   help="HF dir with config/tokenizer (default: <ckpt>/hf_config, written by hf-to-mcore)")
    b.add_argument("--tp", type=int, default=None, help="TP to read it at (default: the checkpoint's)")
    b.add_argument("--pp", type=int, default=None, help="PP to read it at (default: the checkpoint's)")
    b.add_argument("--ep", type=int, default=None, help="MoE: EP to read it at (default: the checkpoint's)")
    b.add_argument("--etp", type=int, default=None, help="MoE: expert TP to read it at (default: the checkpoint's)")
    for p in (a, b):
        p.add_argument("--overwrite", action="store_true", help="replace an existing output (only once complete)")
        p.add_argument("--verify", action="store_true", help="compare Megatron and transformers logits on CPU")
        p.add_argument("--verify-atol", type=float, default=1e-3, help="max abs logit difference --verify allows")


def run(args: argparse.Namespace) -> int:
    from megatron_sortedrl.convert.core import hf_to_mcore, mcore_to_hf, verify

    if args.direction == "hf-to-mcore":
        out = hf_to_mcore(args.hf, args.out, args.tp, args.pp, dtype=args.dtype, overwrite=args.overwrite,
                          ep=args.ep, etp=args.etp)
        if args.verify:
            verify(out, args.hf, atol=args.verify_atol)
    else:
        out = mcore_to_hf(args.ckpt, args.out, args.hf_config, tp=args.tp, pp=args.pp, overwrite=args.overwrite,
                          ep=args.ep, etp=args.etp)
        if args.verify:
            verify(args.ckpt, out, hf_config=args.hf_config, atol=args.verify_atol)
    print(out)
    return 0
