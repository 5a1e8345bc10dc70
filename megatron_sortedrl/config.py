"""The run configuration: one typed schema, filled from YAML and `key=value` overrides.

    python -m megatron_sortedrl config configs/tiny_cpu.yaml rollout.num_workers=2   # print resolved config

Every field is a dataclass field with a default, a one-line help (`metadata["help"]`) and, where it has
one, its range (`help_field(..., min=1)`, `gt=0`, `choices=(...)`). YAML files and overrides (read with
OmegaConf, interpolations such as `${oc.env:...}` resolved) are merged as plain data over the defaults and
checked field by field against the schema (`schema.py`: types from the annotations, ranges from the
metadata, sections vs single values) before the dataclasses are built; then `__post_init__` of each section
checks its combinations and `RunConfig.__post_init__` those across sections. Any error is a `ConfigError`
whose one line names the dotted key, the bad value and what is allowed.

Deliberately absent: config composition (defaults lists, includes). A recipe is one readable file.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_sortedrl.agentic.config import ToolsConfig
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.layout import check_layout
from megatron_sortedrl.schema import RANGE_KEYS, build, defaults, describe, hints, merge, validate
from scheduler.config import SamplingConfig, SchedulerConfig
from speculative.config import SpeculativeConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


def help_field(text: str, default: Any = None, factory: Any = None, **checks: Any) -> Any:
    """A dataclass field with its one line of help (what `config --explain` prints) and its range, if any:
    `min`/`max` (inclusive), `gt`/`lt` (exclusive), `choices` (megatron_sortedrl/schema.py checks them for
    every field when a config loads). Every config schema of the project declares its fields with it."""
    unknown = set(checks) - set(RANGE_KEYS)
    if unknown:
        raise TypeError(f"help_field: unknown check {sorted(unknown)}; use {', '.join(RANGE_KEYS)}")
    meta = {"help": text, **checks}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


TASKS = ("arithmetic", "long_addition", "column_addition", "knights_knaves", "code", "tool_multiplication", "file")
# Tasks whose warm-start solutions trainer.warmup_answer_only_share can cut to a `#### <answer>` line.
ANSWER_LINE_TASKS = ("arithmetic", "long_addition", "column_addition", "tool_multiplication")


@dataclass
class TinyModelConfig:
    """Shape of the built-in tiny model, Qwen2 or Qwen3-MoE (used when model.path does not exist yet)."""

    architecture: str = help_field("qwen2 (dense, the default runs) | qwen3_moe (every layer routed experts, "
                                   "q/k norms; configs/tiny_moe_cpu.yaml).", "qwen2", choices=("qwen2", "qwen3_moe"))
    num_experts: int = help_field("qwen3_moe: routed experts per layer.", 8, min=1)
    num_experts_per_tok: int = help_field("qwen3_moe: experts per token (top-k).", 2, min=1)
    moe_intermediate_size: int = help_field("qwen3_moe: SwiGLU inner width of one expert.", 64, min=1)
    hidden_size: int = help_field("Hidden width.", 128, min=1)
    num_layers: int = help_field("Transformer layers.", 2, min=1)
    num_attention_heads: int = help_field("Query heads; hidden_size / heads must be a vLLM CPU head_dim (32, 64, ...).", 4, min=1)
    num_key_value_heads: int = help_field("Key/value heads (grouped-query attention).", 2, min=1)
    intermediate_size: int = help_field("SwiGLU inner width.", 256, min=1)
    max_position_embeddings: int = help_field("Longest sequence (prompt + response) in tokens.", 1024, min=1)
    rope_theta: float = help_field("RoPE base.", 10000.0, gt=0)
    tie_word_embeddings: bool = help_field("Share input embedding and output projection.", True)
    seed: int = help_field("Seed of the random initialisation.", 0, min=0)

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.tiny.{key}", getattr(self, key), "an integer >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "model.tiny.num_attention_heads", self.num_attention_heads, f"a divisor of hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "model.tiny.num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads ({self.num_attention_heads})",
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError("model.tiny.num_experts_per_tok", self.num_experts_per_tok,
                              f"at most num_experts ({self.num_experts})")


@dataclass
class ModelConfig:
    path: str = help_field("Hugging Face model directory (config.json, safetensors, tokenizer).", "runs/tiny_model")
    build_tiny_if_missing: bool = help_field("Build the tiny CPU model at `path` when the directory does not exist.", True)
    tiny: TinyModelConfig = help_field("Shape of the built-in tiny model.", factory=TinyModelConfig)
    dtype: str = help_field("Parameter dtype: float32 | bfloat16 | float16 (float32 on CPU).", "float32",
                            choices=("float32", "bfloat16", "float16"))
    rope_scaling: dict[str, Any] = help_field(
        "RoPE scaling applied to trainer and engines instead of config.json's (empty: config.json's). Types: "
        "default | linear | llama3 | yarn, e.g. {rope_type: yarn, factor: 4.0, original_max_position_embeddings: "
        "32768} to run Qwen2.5 past 32k tokens.", factory=dict)
    moe_aux_loss_coef: float = help_field(
        "MoE models: load-balancing auxiliary loss coefficient (0: off, the RL default, so only the policy gradient "
        "moves the router; pretraining uses about 1e-3).", 0.0, min=0, max=1)
    moe_z_loss_coef: float = help_field("MoE models: router z-loss coefficient (0: off; about 1e-3 when used).", 0.0,
                                        min=0, max=1)
    moe_grouped_gemm: bool = help_field(
        "MoE models on GPU with Transformer Engine: run each rank's experts as one grouped GEMM; CPU always runs "
        "them one after another.", True)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("model.dtype", self.dtype, "one of float32, bfloat16, float16")
        if self.rope_scaling:
            from megatron_sortedrl.rope import check_rope_scaling

            check_rope_scaling(dict(self.rope_scaling), "model.rope_scaling")


@dataclass
class DataConfig:
    task: str = help_field("arithmetic | long_addition | column_addition | knights_knaves | code | "
                           "tool_multiplication (procedural; the last needs tools.tools with calculator) | "
                           "file (train_files/eval_files).", "arithmetic", choices=TASKS)
    train_files: list[str] = help_field("jsonl or parquet files (verl/DAPO layout) when task=file.", factory=list)
    eval_files: list[str] = help_field("Held-out jsonl or parquet files when task=file.", factory=list)
    prompt_key: str = help_field("Dotted key of the prompt in a row (a string or a list of chat messages).", "prompt")
    answer_key: str = help_field(
        "Dotted key of the ground truth; tried in order: this, reward_model.ground_truth, answer.", "ground_truth"
    )
    on_bad_row: str = help_field("error: stop at the first malformed row; skip: skip and report the count.", "error",
                                 choices=("error", "skip"))
    num_train_prompts: int = help_field("Procedural tasks: prompts in the training set.", 256, min=1)
    num_eval_prompts: int = help_field("Procedural tasks: prompts in the held-out set.", 64, min=0)
    min_difficulty: int = help_field("Procedural tasks: smallest difficulty (digits, or K&K people).", 1, min=1)
    max_difficulty: int = help_field("Procedural tasks: largest difficulty.", 4, min=1)
    seed: int = help_field("Seed of the procedural generator (train and eval sets use different streams).", 1234, min=0)
    apply_chat_template: bool = help_field("Wrap prompts with the tokenizer's chat template (real chat models).", False)
    tool_schemas_in_prompt: bool = help_field(
        "With tools: give the template the tools' schemas (tools=). false leaves them out, for a model that learns "
        "its tools in the warm start (the built-in tiny model reads them as ~800 characters, one token each).", True)
    max_prompt_length: int = help_field("Prompts longer than this many tokens are reported and skipped.", 256, min=1)
    reward_fn: str = help_field(
        "Dotted path of `def reward(sample, ground_truth) -> float`; empty picks the task's default.", ""
    )
    reward_timeout_s: float = help_field(
        "Seconds one reward call may take; a call that takes longer scores 0, is counted and logged.", 10.0, gt=0)
    reward_workers: int = help_field("Processes scoring samples while rollout goes on.", 1, min=1)
    num_epochs: int = help_field("Passes over the training prompts; the run ends when they are used up (0: no limit).", 0, min=0)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError("data.task", self.task, "one of " + ", ".join(TASKS))
        if self.on_bad_row not in ("error", "skip"):
            raise ConfigError("data.on_bad_row", self.on_bad_row, "one of error, skip")
        if self.task == "file" and not self.train_files:
            raise ConfigError("data.train_files", list(self.train_files), "at least one jsonl/parquet path when data.task=file")
        if self.min_difficulty < 1 or self.max_difficulty < self.min_difficulty:
            raise ConfigError(
                "data.max_difficulty", self.max_difficulty, f"an integer >= min_difficulty ({self.min_difficulty}) >= 1"
            )
        if self.task == "knights_knaves" and not (2 <= self.min_difficulty and self.max_difficulty <= 7):
            raise ConfigError(
                "data.min_difficulty", (self.min_difficulty, self.max_difficulty), "2..7 people for knights_knaves"
            )
        if self.task == "column_addition" and self.max_difficulty > 52:
            raise ConfigError("data.max_difficulty", self.max_difficulty, "at most 52 digits for column_addition (one letter per column)")
        if self.reward_timeout_s <= 0:
            raise ConfigError("data.reward_timeout_s", self.reward_timeout_s, "a positive number of seconds")
        if self.reward_workers < 1:
            raise ConfigError("data.reward_workers", self.reward_workers, "an integer >= 1")
        if self.num_epochs < 0:
            raise ConfigError("data.num_epochs", self.num_epochs, "an integer >= 0 (0: no limit)")
        if self.reward_fn and not re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", self.reward_fn):
            raise ConfigError("data.reward_fn", self.reward_fn, "a dotted path such as my_pkg.rewards.score")


@dataclass
class RewardConfig:
    """The reward stage (megatron_sortedrl/reward_stage.py); data.reward_workers and data.reward_timeout_s
    stay the starting size and the (largest) per-sample limit."""

    backend: str = help_field("process: spawned processes on the driver's node; ray: CPU-only Ray actors on "
                              "any node of the cluster.", "process", choices=("process", "ray"))
    ray_num_cpus: float = help_field("backend=ray: CPUs each reward actor reserves.", 1.0, gt=0)
    autoscale: bool = help_field("Resize the workers from the measured backlog during the run.", False)
    min_workers: int = help_field("autoscale: fewest workers (0: data.reward_workers).", 0, min=0)
    max_workers: int = help_field("autoscale: most workers (0: data.reward_workers).", 0, min=0)
    target_drain_s: float = help_field("autoscale: enough workers to score the backlog within this.", 1.0, gt=0)
    scale_interval_s: float = help_field("autoscale: seconds between two sizing decisions.", 0.5, gt=0)
    idle_s: float = help_field("autoscale: give one worker back after this long with nothing pending.", 10.0, min=0)
    timeout: str = help_field("fixed: data.reward_timeout_s for every sample; history: per prompt, "
                              "timeout_multiple x its slowest passing sample, within bounds.", "fixed",
                              choices=("fixed", "history"))
    timeout_multiple: float = help_field("timeout=history: multiple of the slowest passing scoring.", 3.0, gt=0)
    min_timeout_s: float = help_field("timeout=history: smallest per-prompt limit in seconds.", 0.5, gt=0)
    order: str = help_field("harvest: complete groups first (what the harvest takes); fifo: arrival order.",
                            "harvest", choices=("harvest", "fifo"))
    max_batch: int = help_field("Samples sent to a worker in one message (batch rewards: per call).", 64, min=1)
    sandbox: str = help_field("Code rewards: auto (bubblewrap when it works, else fallback) | bwrap | fallback.",
                              "auto", choices=("auto", "bwrap", "fallback"))
    judge_model: str = help_field("Model-based rewards (rewards/judge.py): the judge's Hugging Face directory, "
                                  "served by a vLLM engine in each reward worker.", "")
    code_partial_credit: bool = help_field("Code rewards: a program that runs every test but fails some scores the "
                                           "share it passed (else 0); errors and timeouts still score 0.", False)
    warm_sandbox: bool = help_field("Code rewards: each worker starts the next program's sandbox ahead, while it "
                                    "waits, so sandbox start-up is off the critical path.", True)

    def __post_init__(self) -> None:
        for key, val, allowed in (("backend", self.backend, ("process", "ray")),
                                  ("timeout", self.timeout, ("fixed", "history")),
                                  ("order", self.order, ("harvest", "fifo")),
                                  ("sandbox", self.sandbox, ("auto", "bwrap", "fallback"))):
            if val not in allowed:
                raise ConfigError(f"reward.{key}", val, "one of " + ", ".join(allowed))
        for key in ("ray_num_cpus", "target_drain_s", "scale_interval_s", "timeout_multiple", "min_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"reward.{key}", getattr(self, key), "a positive number")
        if self.idle_s < 0 or self.min_workers < 0 or self.max_workers < 0 or self.max_batch < 1:
            raise ConfigError("reward.max_batch" if self.max_batch < 1 else "reward.min_workers",
                              (self.min_workers, self.max_workers, self.max_batch, self.idle_s),
                              "min/max_workers >= 0, max_batch >= 1, idle_s >= 0")
        if self.max_workers and self.min_workers > self.max_workers:
            raise ConfigError("reward.max_workers", self.max_workers, f">= reward.min_workers ({self.min_workers})")


@dataclass
class RolloutConfig:
    num_workers: int = help_field("vLLM engines at TP=1 (short-round layout); each is one Ray actor.", 1, min=1)
    tensor_parallel_size: int = help_field("Rollout TP of the short-round layout.", 1, min=1)
    long_round_tensor_parallel_size: int = help_field("Rollout TP of the long-round layout (elastic parallelism).", 1, min=1)
    n_samples_per_prompt: int = help_field("Responses per prompt (the GRPO group).", 4, min=1)
    temperature: float = help_field("Sampling temperature.", 1.0, min=0)
    top_p: float = help_field("Nucleus sampling threshold (the trainer scores the same truncated distribution).", 1.0, gt=0, max=1)
    top_k: int = help_field("Sample among the k most likely tokens (0: off); the trainer scores the same.", 0, min=0)
    max_response_length: int = help_field("Longest response in tokens.", 256, min=1)
    max_num_seqs: int = help_field("Concurrent sequences per engine (continuous batching).", 64, min=1)
    kv_cache_gib: float = help_field("CPU engines: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).", 1.0, gt=0)
    gpu_memory_utilization: float = help_field("GPU engines: fraction of GPU memory vLLM may use.", 0.5, gt=0, max=1)
    enforce_eager: bool = help_field("Disable CUDA graphs / compilation (faster start, needed on CPU).", True)
    request_timeout_s: float = help_field("A worker that produces nothing for this long is declared hung.", 600.0, gt=0)
    executor: str = help_field(
        "vLLM executor of each engine: auto (uni for a CPU engine of TP 1, mp otherwise) | mp (a worker process per "
        "TP rank) | uni (the model in the engine-core process; TP 1 only, a TP > 1 layout uses mp). On 2 CPU cores "
        "uni generated 1.22x the tokens/s of mp (docs/benchmarks/engine_executor.json).", "auto",
        choices=("auto", "mp", "uni"))
    return_routed_experts: str = help_field(
        "MoE engines return each token's routed experts for routing replay: auto (on for an MoE model with "
        "algorithm.routing_replay; CPU engines capture them in the worker extension, without prefix caching) | on | "
        "off.", "auto",
        choices=("auto", "on", "off"))
    dtype: str = help_field(
        "Engine parameter dtype: empty = model.dtype | float32 | bfloat16 | float16. bfloat16 engines beside a "
        "float32 trainer is the usual GPU setting; their log-probs then differ from the trainer's (the mismatch "
        "`train/mismatch/*` measures, docs/models.md).", "", choices=("", "float32", "bfloat16", "float16"))

    def __post_init__(self) -> None:
        if self.dtype not in ("", "float32", "bfloat16", "float16"):
            raise ConfigError("rollout.dtype", self.dtype, "empty (model.dtype) or one of float32, bfloat16, float16")
        if self.return_routed_experts not in ("auto", "on", "off"):
            raise ConfigError("rollout.return_routed_experts", self.return_routed_experts, "one of auto, on, off")
        for key in ("num_workers", "tensor_parallel_size", "long_round_tensor_parallel_size", "n_samples_per_prompt",
                    "max_response_length", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key}", getattr(self, key), "an integer >= 1")
        if self.temperature < 0:
            raise ConfigError("rollout.temperature", self.temperature, "a float >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("rollout.top_p", self.top_p, "a float in (0, 1]")
        if self.top_k < 0:
            raise ConfigError("rollout.top_k", self.top_k, "an integer >= 0 (0: off)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.gpu_memory_utilization", self.gpu_memory_utilization, "a float in (0, 1]")
        if self.kv_cache_gib <= 0:
            raise ConfigError("rollout.kv_cache_gib", self.kv_cache_gib, "a positive float")
        if self.executor not in ("auto", "mp", "uni"):
            raise ConfigError("rollout.executor", self.executor, "one of auto, mp, uni")


@dataclass
class RecomputeConfig:
    """Activation recompute (Megatron's `recompute_granularity`, `recompute_method`, `recompute_num_layers`)."""

    granularity: str = help_field(
        "auto: the launch planner picks the least recompute that fits the device | none | selective (recompute "
        "the attention core only) | full (keep one input per checkpointed layer group, recompute the rest).", "auto",
        choices=("auto", "none", "selective", "full"))
    method: str = help_field(
        "Full recompute only: uniform (checkpoint every group of num_layers layers) | block (checkpoint the "
        "first num_layers layers of each pipeline stage, keep the rest).", "uniform", choices=("uniform", "block"))
    num_layers: int = help_field("Full recompute only: layers per group (uniform) or checkpointed layers per stage (block).", 1, min=1)

    def __post_init__(self) -> None:
        if self.granularity not in ("auto", "none", "selective", "full"):
            raise ConfigError("parallel.recompute.granularity", self.granularity, "one of auto, none, selective, full")
        if self.method not in ("uniform", "block"):
            raise ConfigError("parallel.recompute.method", self.method, "one of uniform, block")
        if self.num_layers < 1:
            raise ConfigError("parallel.recompute.num_layers", self.num_layers, "an integer >= 1")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = help_field("Trainer TP; must divide attention heads and key/value heads.", 1, min=1)
    pipeline_model_parallel_size: int = help_field("Trainer PP; must divide the number of layers.", 1, min=1)
    data_parallel_size: int = help_field("Trainer DP; world size is TP x PP x DP.", 1, min=1)
    sequence_parallel: bool = help_field(
        "Megatron sequence parallelism: norms and residuals run on 1/TP of each micro-batch's tokens per TP rank "
        "(TP > 1; no effect at TP 1; micro-batches are padded to a multiple of TP). CPU and GPU.", False)
    use_distributed_optimizer: bool = help_field("Megatron distributed optimizer (GPU only; CPU uses the plain optimizer).", False)
    expert_model_parallel_size: int = help_field(
        "MoE models: expert parallelism (EP); the experts of each layer are split over EP ranks, carved out of "
        "TP x DP as megatron-core does; must divide the number of experts. 1 for dense models.", 1, min=1)
    expert_tensor_parallel_size: int = help_field(
        "MoE models: tensor parallelism inside each expert (ETP); 0 means the same as tensor_model_parallel_size.",
        0, min=0)
    recompute: RecomputeConfig = help_field("Activation recompute (trades compute for activation memory).",
                                            factory=RecomputeConfig)

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key}", getattr(self, key), "an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size


@dataclass
class AlgorithmConfig:
    advantage: str = help_field("grpo | reinforce_pp | reinforce_pp_baseline | rloo.", "grpo",
                                choices=("grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"))
    clip_low: float = help_field("PPO clip: ratio lower bound is 1 - clip_low.", 0.2, min=0, lt=1)
    clip_high: float = help_field("PPO clip-higher: ratio upper bound is 1 + clip_high.", 0.28, min=0)
    loss_aggregation: str = help_field("token: mean over all tokens; sequence: mean of per-sequence means.", "token",
                                       choices=("token", "sequence"))
    kl_coef: float = help_field("KL penalty to the frozen reference model (0 disables the reference).", 0.0, min=0)
    entropy_coef: float = help_field("Entropy bonus coefficient (entropy is always logged).", 0.0, min=0)
    tis_cap: float = help_field("Truncated importance sampling cap on trainer/rollout ratio (0 disables).", 2.0, min=0)
    normalize_advantage_std: bool = help_field("GRPO: divide by the group's reward std.", True)
    clip_ratio_c: float = help_field(
        "Dual-clip constant (verl's, default 3): for negative advantages the per-token loss is capped at "
        "-clip_ratio_c * A, so far off-policy tokens cannot grow it without bound; > 1, or 0 to turn it off.", 3.0, min=0)
    log_ratio_clamp: float = help_field(
        "Clamp of log(pi / pi_old) to [-x, x] before exp (verl: 20), so a stale token cannot overflow the ratio; "
        "0 turns it off.", 20.0, min=0)
    routing_replay: bool = help_field(
        "MoE models: the trainer replays the experts the engines routed each token to (R3) in the log-prob and "
        "training passes (rollout.return_routed_experts); dense models ignore it.", False)
    # Trainer/rollout mismatch corrections beside TIS (algorithms.py: rollout_correction); each 0 = off.
    mis_high: float = help_field(
        "Masked importance sampling: tokens whose trainer/engine ratio leaves [mis_low, mis_high] are masked from "
        "the loss, the rest weighted by the ratio (replaces TIS's truncation; tis_cap then unused); > 1, or 0 off.",
        0.0, min=0)
    mis_low: float = help_field("Masked importance sampling: lower end of the kept ratio band, in [0, 1).", 0.0,
                                min=0, lt=1)
    icepop_beta: float = help_field(
        "IcePop token masking: tokens whose trainer/engine ratio leaves [1/beta, beta] get no gradient; > 1, or 0 off.",
        0.0, min=0)
    seq_mask_geo_band: float = help_field(
        "Sequence mask: drop a whole sequence whose geometric-mean trainer/engine ratio leaves [1/x, x]; > 1, or 0 off.",
        0.0, min=0)
    seq_mask_token_band: float = help_field(
        "Sequence mask: drop a whole sequence any of whose tokens' trainer/engine ratio leaves [1/x, x]; > 1, or 0 off.",
        0.0, min=0)

    def __post_init__(self) -> None:
        for key in ("mis_high", "icepop_beta", "seq_mask_geo_band", "seq_mask_token_band"):
            v = getattr(self, key)
            if v != 0 and not v > 1:
                raise ConfigError(f"algorithm.{key}", v, "a float > 1, or 0 to turn it off")
        if not 0 <= self.mis_low < 1:
            raise ConfigError("algorithm.mis_low", self.mis_low, "a float in [0, 1)")
        if self.advantage not in ("grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"):
            raise ConfigError("algorithm.advantage", self.advantage, "one of grpo, reinforce_pp, reinforce_pp_baseline, rloo")
        if self.loss_aggregation not in ("token", "sequence"):
            raise ConfigError("algorithm.loss_aggregation", self.loss_aggregation, "one of token, sequence")
        for key in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "tis_cap"):
            if getattr(self, key) < 0:
                raise ConfigError(f"algorithm.{key}", getattr(self, key), "a float >= 0")
        if self.clip_low >= 1:
            raise ConfigError("algorithm.clip_low", self.clip_low, "a float in [0, 1)")
        if self.clip_ratio_c != 0 and not self.clip_ratio_c > 1:
            raise ConfigError("algorithm.clip_ratio_c", self.clip_ratio_c, "a float > 1 (dual-clip), or 0 to turn it off")
        if not self.log_ratio_clamp >= 0:
            raise ConfigError("algorithm.log_ratio_clamp", self.log_ratio_clamp, "a float >= 0 (0: no clamp)")


@dataclass
class TrainerConfig:
    total_steps: int = help_field("Optimizer updates of the RL phase.", 40, min=1)
    lr: float = help_field("Adam learning rate.", 1e-4, gt=0)
    lr_warmup_steps: int = help_field("RL steps of linear learning-rate warm-up from 0.", 0, min=0)
    lr_decay_style: str = help_field("Learning rate after warm-up over total_steps: constant | linear | cosine.", "constant",
                                     choices=("constant", "linear", "cosine"))
    weight_decay: float = help_field("AdamW weight decay.", 0.0, min=0)
    grad_clip: float = help_field("Gradient norm clip (0 disables).", 1.0, min=0)
    micro_batch_tokens: int = help_field("Token budget of one packed micro-batch.", 4096, min=1)
    cpu_threads: int = help_field(
        "CPU only: torch threads of each trainer rank (0: Ray's default, one per CPU the rank reserves). "
        "Training and generation take turns, so a colocated trainer may use every core while the engines "
        "wait, as a colocated GPU trainer uses every GPU; more threads than cores per rank only slow it down.", 0, min=0)
    logprob_chunk_tokens: int = help_field(
        "Tokens per chunk of the log-prob / entropy computation: bounds its float32 working set to "
        "chunk x vocabulary / TP (x TP while top-p/top-k truncate).", 512, min=1)
    warmup_sft_steps: int = help_field("Supervised warm-start steps on worked solutions before RL (0 skips).", 300, min=0)
    warmup_sft_lr: float = help_field("Learning rate of the supervised warm-start.", 3e-3, gt=0)
    warmup_sft_batch: int = help_field("Worked solutions per supervised warm-start step.", 16, min=1)
    warmup_sft_problems: int = help_field(
        "Procedural tasks: warm start on this many fresh problems (another seed than train and eval) instead of "
        "the training prompts, so it learns the procedure rather than the RL prompts' answers (0: the training "
        "prompts).", 0, min=0)
    warmup_answer_only_share: float = help_field(
        "Share of warm-start solutions cut to their answer line (`#### <answer>`; arithmetic, long_addition and "
        "column_addition): "
        "a teacher that sometimes skips the worked steps. The model then answers some problems without working, "
        "and RL has to learn that the steps pay off, as reasoning RL learns to think longer (the learning-parity "
        "workload, configs/learning_cpu.yaml). 0 keeps every worked solution.", 0.0, min=0, max=1)
    eval_interval: int = help_field("Evaluate on the held-out set every this many steps (0 disables).", 10, min=0)
    stream: bool = help_field(
        "Stream training (trainer/stream.py): backward of each finished prompt group while the round still "
        "generates, one optimizer step at harvest (equal to the batch update).", False)

    def __post_init__(self) -> None:
        for key in ("total_steps", "micro_batch_tokens", "logprob_chunk_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key}", getattr(self, key), "an integer >= 1")
        for key in ("warmup_sft_steps", "eval_interval", "warmup_sft_problems", "cpu_threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}", getattr(self, key), "an integer >= 0")
        if self.lr <= 0:
            raise ConfigError("trainer.lr", self.lr, "a positive float")
        if self.warmup_sft_batch < 1:
            raise ConfigError("trainer.warmup_sft_batch", self.warmup_sft_batch, "an integer >= 1")
        if self.lr_warmup_steps < 0:
            raise ConfigError("trainer.lr_warmup_steps", self.lr_warmup_steps, "an integer >= 0")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError("trainer.lr_decay_style", self.lr_decay_style, "one of constant, linear, cosine")


@dataclass
class CheckpointConfig:
    dir: str = help_field("Checkpoint directory; empty means <logging.run_dir>/checkpoints.", "")
    save_interval: int = help_field("Save every this many steps (0: only at the end).", 10, min=0)
    keep_last: int = help_field("Checkpoints kept; older ones are deleted after a newer one is complete.", 2, min=1)
    resume: str = help_field(
        "auto: continue from the newest complete checkpoint of this run if there is one; required: the same, "
        "but fail when there is none; never: start over; or a checkpoint or run directory to continue from.", "auto")

    def __post_init__(self) -> None:
        if self.save_interval < 0:
            raise ConfigError("checkpoint.save_interval", self.save_interval, "an integer >= 0")
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last", self.keep_last, "an integer >= 1")
        if not self.resume:
            raise ConfigError("checkpoint.resume", self.resume, "auto, required, never, or a checkpoint/run directory")


@dataclass
class LoggingConfig:
    run_dir: str = help_field("Directory of this run: metrics, timeline, report, checkpoints.", "runs/tiny_cpu")
    tensorboard: bool = help_field("Write TensorBoard event files to <run_dir>/tensorboard.", True)
    trackers: list[str] = help_field(
        "Experiment trackers that also get every step's metrics and the run config: wandb, mlflow (the "
        "`tracking` extra installs them); e.g. [wandb, mlflow].", factory=list)
    project: str = help_field("wandb project and MLflow experiment name.", "megatron-sortedrl")
    run_name: str = help_field("Run name in wandb and MLflow (empty: the config's `name`).", "")
    wandb_entity: str = help_field("wandb entity (team or user; empty: wandb's default).", "")
    wandb_mode: str = help_field(
        "wandb mode: online | offline (files in <run_dir>/wandb, upload later with `wandb sync`) | disabled; "
        "empty: wandb's default (WANDB_MODE, else online).", "")
    mlflow_tracking_uri: str = help_field(
        "MLflow tracking URI: a server (http://host:5000), a database or file:<dir>; empty: MLFLOW_TRACKING_URI, "
        "else file:<run_dir>/mlruns.", "")
    log_interval: int = help_field("Print progress every this many steps.", 1, min=1)
    nvml_sample_hz: float = help_field("NVML utilization sampling rate on GPU nodes (0 disables).", 10.0, min=0)

    def __post_init__(self) -> None:
        from megatron_sortedrl.telemetry.trackers import TRACKERS, check_trackers_installed

        trackers = list(self.trackers)
        if any(t not in TRACKERS for t in trackers) or len(set(trackers)) < len(trackers):
            raise ConfigError("logging.trackers", trackers,
                              f"a list of distinct names from {', '.join(TRACKERS)} (TensorBoard: logging.tensorboard)")
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise ConfigError("logging.wandb_mode", self.wandb_mode, "one of online, offline, disabled, or empty")
        check_trackers_installed(trackers)
        if self.log_interval < 1:
            raise ConfigError("logging.log_interval", self.log_interval, "an integer >= 1")
        if self.nvml_sample_hz < 0:
            raise ConfigError("logging.nvml_sample_hz", self.nvml_sample_hz, "a float >= 0")


@dataclass
class ClusterConfig:
    device: str = help_field("auto | cpu | gpu: backend for trainer and rollout (auto probes CUDA).", "auto",
                             choices=("auto", "cpu", "gpu"))
    ray_address: str = help_field("Ray cluster address; empty starts a local Ray instance.", "")
    num_nodes: int = help_field("Nodes in the allocation.", 1, min=1)
    gpus_per_node: int = help_field("GPUs per node (0 on CPU machines).", 0, min=0)
    cpus_per_node: int = help_field(
        "CPUs each node's srun step asks for under Slurm, which `ray start` then advertises (0: Slurm's "
        "SLURM_CPUS_ON_NODE).", 0, min=0)
    socket_ifname: str = help_field(
        "Network interface for gloo and NCCL sockets (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for every "
        "rank and engine), e.g. ib0 or eth0; empty: the environment's, else the libraries' own choice.", "")
    colocate: bool = help_field(
        "Trainer ranks and rollout engines on the same GPUs, taking turns: engines wake, generate and sleep; the "
        "trainer's state leaves the GPU during rollout (docs/cluster.md).", False)
    engine_sleep_level: int = help_field(
        "Colocated: what a sleeping engine frees. 1: KV cache freed, weights kept in host memory; 2: KV cache and "
        "weights freed (every step hands new weights over at wake anyway).", 2, choices=(1, 2))
    offload_trainer: bool = help_field(
        "Colocated: the trainer's parameters, gradients and optimizer state move to host memory while the "
        "engines generate and back for the update; false keeps them on the GPU (less KV cache for the engines).",
        True)
    startup_timeout_s: float = help_field(
        "Seconds to wait for each cluster start-up step (placement groups, trainer set-up, engine start) before "
        "failing with what is missing.", 900.0, gt=0)
    gpu_memory_gib: float = help_field("Memory of one GPU in GiB (80 GB cards: 80); the launch planner checks against it.", 80.0, gt=0)
    host_memory_gib: float = help_field(
        "Host memory of one node in GiB for the launch planner; 0: this machine's RAM (right when the check runs "
        "on a node of the allocation, as `train` does under Slurm).", 0.0, min=0)
    worker_niceness: int = help_field(
        "Niceness of the Ray workers (trainer ranks, engines) of the local Ray instance a run starts (no "
        "ray_address); -1: Ray's default, 15, under which they lose the CPU to the driver, its reward workers and "
        "anything else at 0. The CPU presets set 0: there they share a few cores with the driver.", -1, min=-1, max=19)

    def __post_init__(self) -> None:
        if not -1 <= self.worker_niceness <= 19:
            raise ConfigError("cluster.worker_niceness", self.worker_niceness,
                              "an integer from 0 to 19, or -1 for Ray's default")
        if self.device not in ("auto", "cpu", "gpu"):
            raise ConfigError("cluster.device", self.device, "one of auto, cpu, gpu")
        if self.gpu_memory_gib <= 0:
            raise ConfigError("cluster.gpu_memory_gib", self.gpu_memory_gib, "a positive number of GiB")
        if self.host_memory_gib < 0:
            raise ConfigError("cluster.host_memory_gib", self.host_memory_gib, "a number of GiB >= 0 (0: this machine's RAM)")
        if self.num_nodes < 1:
            raise ConfigError("cluster.num_nodes", self.num_nodes, "an integer >= 1")
        if self.gpus_per_node < 0:
            raise ConfigError("cluster.gpus_per_node", self.gpus_per_node, "an integer >= 0")
        if self.cpus_per_node < 0:
            raise ConfigError("cluster.cpus_per_node", self.cpus_per_node, "an integer >= 0")
        if not re.fullmatch(r"[\w.:@,^=-]*", self.socket_ifname):
            raise ConfigError("cluster.socket_ifname", self.socket_ifname, "an interface name such as eth0 or ib0 "
                              "(gloo/NCCL syntax: a comma-separated list, ^ excludes)")
        if self.colocate:
            # Engines would ask for GPUs the trainer's placement group holds and wait forever.
            raise ConfigError("cluster.colocate", self.colocate,
                              "false: trainer/rollout colocation is not implemented; give rollout its own nodes")
        if self.engine_sleep_level not in (1, 2):
            raise ConfigError("cluster.engine_sleep_level", self.engine_sleep_level,
                              "1 (weights kept in host memory) or 2 (weights freed)")
        if not self.startup_timeout_s > 0:
            raise ConfigError("cluster.startup_timeout_s", self.startup_timeout_s, "a number of seconds > 0")


@dataclass
class PlanConfig:
    """The launch planner (`python -m megatron_sortedrl plan`, and the check `train` runs at start; docs/scaling.md)."""

    check: str = help_field(
        "What `train` does with a plan that does not fit: error (refuse, exit 2) | warn (print the line, go on) | "
        "skip (no plan; recompute auto then means none).", "error", choices=("error", "warn", "skip"))
    margin: float = help_field("Fraction of every memory kept free (fragmentation, allocator caches, NCCL).", 0.10, min=0, lt=1)
    sync_bandwidth_gbs: float = help_field(
        "GB/s one weight-sync sender reaches to the engines; 0: 20 on GPU (one 200 Gb/s NIC per GPU at 80%), "
        "1 on CPU (Ray object store).", 0.0, min=0)
    engine_reserve_gib: float = help_field(
        "GPU memory of one engine rank outside weights and KV cache: CUDA graphs, the profiling run's activation "
        "peak, CUDA context and NCCL buffers.", 4.0, min=0)
    process_host_gib: float = help_field(
        "Host memory of one Python process (torch, Megatron or vLLM imports, CUDA context) before its data; "
        "0: 2 on GPU nodes, 1 on CPU.", 0.0, min=0)
    offload_gbs: float = help_field(
        "Colocated: GB/s of one GPU's host-device copies (trainer offload and reload, a level-1 engine's weights); "
        "0: 25 on GPU (PCIe, every GPU of a node copying at once), 5 on CPU.", 0.0, min=0)
    handoff_gbs: float = help_field(
        "Colocated: GB/s at which an engine GPU receives the model from the trainer over CUDA IPC; 0: 100 on GPU, "
        "plan.sync_bandwidth_gbs on CPU.", 0.0, min=0)

    def __post_init__(self) -> None:
        if self.check not in ("error", "warn", "skip"):
            raise ConfigError("plan.check", self.check, "one of error, warn, skip")
        if not 0 <= self.margin < 1:
            raise ConfigError("plan.margin", self.margin, "a fraction in [0, 1)")
        for key in ("sync_bandwidth_gbs", "engine_reserve_gib", "process_host_gib", "offload_gbs", "handoff_gbs"):
            if getattr(self, key) < 0:
                raise ConfigError(f"plan.{key}", getattr(self, key), "a number >= 0")


@dataclass
class RunConfig:
    name: str = help_field("Run name shown in logs and reports.", "tiny_cpu")
    seed: int = help_field("Global seed (data order, sampling, initialisation).", 0, min=0)
    model: ModelConfig = help_field("Policy model.", factory=ModelConfig)
    data: DataConfig = help_field("Prompts, ground truth, reward function.", factory=DataConfig)
    rollout: RolloutConfig = help_field("vLLM rollout workers.", factory=RolloutConfig)
    scheduler: SchedulerConfig = help_field("Two-tier length-aware scheduler.", factory=SchedulerConfig)
    speculative: SpeculativeConfig = help_field("HistoSpec speculative decoding.", factory=SpeculativeConfig)
    algorithm: AlgorithmConfig = help_field("Advantages and policy loss.", factory=AlgorithmConfig)
    trainer: TrainerConfig = help_field("Optimisation schedule.", factory=TrainerConfig)
    parallel: ParallelConfig = help_field("Trainer parallel layout.", factory=ParallelConfig)
    checkpoint: CheckpointConfig = help_field("Saving and resuming.", factory=CheckpointConfig)
    logging: LoggingConfig = help_field("Run directory and metrics sinks.", factory=LoggingConfig)
    cluster: ClusterConfig = help_field("Machines and devices.", factory=ClusterConfig)
    plan: PlanConfig = help_field("Launch planner: memory fit check before a run starts.", factory=PlanConfig)
    reward: RewardConfig = help_field("Reward stage: workers, scaling, timeouts, order, sandbox.", factory=RewardConfig)
    sampling: SamplingConfig = help_field("DAPO dynamic sampling, overlong shaping, reward-history skip.", factory=SamplingConfig)
    tools: ToolsConfig = help_field("Multi-turn tool use: tools, call format, turn limit (docs/agentic.md).",
                                    factory=ToolsConfig)

    def __post_init__(self) -> None:
        hf_config = Path(self.model.path) / "config.json"
        if hf_config.is_file():  # a real model directory: check the layout against its shape
            shape = json.loads(hf_config.read_text())
            heads = shape.get("num_attention_heads", 1)
            self.validate_model_shape(heads, shape.get("num_key_value_heads", heads), shape.get("num_hidden_layers", 1))
            self.validate_context(shape)
        elif self.model.build_tiny_if_missing:
            tiny = self.model.tiny
            self.validate_model_shape(tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_layers)
            # The context is checked once the model exists (the rollout pool checks it before any engine
            # starts): scheduler simulations describe models they never build with tiny shapes.
        s, r = self.scheduler, self.rollout
        samples_per_round = s.rollout_batch_size * r.n_samples_per_prompt
        if samples_per_round < s.update_batch_size:
            raise ConfigError(
                "scheduler.rollout_batch_size",
                s.rollout_batch_size,
                f"at least update_batch_size / n_samples_per_prompt = {s.update_batch_size} / {r.n_samples_per_prompt} "
                f"(a round of {samples_per_round} samples cannot fill an update batch of {s.update_batch_size})",
            )
        if s.update_batch_size % r.n_samples_per_prompt:
            raise ConfigError(
                "scheduler.update_batch_size",
                s.update_batch_size,
                f"a multiple of rollout.n_samples_per_prompt ({r.n_samples_per_prompt}) so groups are never split",
            )
        adv = self.algorithm.advantage
        # Group-baseline estimators (algorithms.GROUP_BASELINE) subtract a per-prompt statistic: one sample per
        # prompt would train all-zero (or undefined) advantages.
        if adv in ("grpo", "reinforce_pp_baseline", "rloo") and r.n_samples_per_prompt < 2:
            raise ConfigError("rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                              f">= 2 for {adv} (algorithm.advantage={adv} subtracts a per-prompt baseline: with one "
                              "sample every advantage is 0), or algorithm.advantage=reinforce_pp")
        # Batch-whitened estimators (algorithms.BATCH_WHITENED) need the whole update batch before any advantage
        # is known, so a prompt group streamed before harvest cannot be trained exactly.
        if self.trainer.stream and adv in ("reinforce_pp", "reinforce_pp_baseline"):
            raise ConfigError("trainer.stream", True,
                              f"false with algorithm.advantage={adv} (it whitens over the whole batch, unknown while "
                              "groups are streamed); use grpo or rloo to stream")
        if self.trainer.warmup_answer_only_share > 0 and self.data.task not in ANSWER_LINE_TASKS:
            raise ConfigError("trainer.warmup_answer_only_share", self.trainer.warmup_answer_only_share,
                              f"0 with data.task={self.data.task} (only {', '.join(ANSWER_LINE_TASKS)} solutions have "
                              "an answer to cut them to)")
        if self.data.task == "tool_multiplication" and "calculator" not in self.tools.tools:
            raise ConfigError("tools.tools", list(self.tools.tools), "a list with calculator for "
                              "data.task=tool_multiplication (its worked solutions call it; configs/tools_cpu.yaml)")
        if self.sampling.overlong_buffer >= r.max_response_length:
            raise ConfigError("sampling.overlong_buffer", self.sampling.overlong_buffer,
                              f"fewer tokens than rollout.max_response_length ({r.max_response_length})")
        check_layout(self)

    @property
    def max_model_len(self) -> int:
        """Longest sequence an engine must hold: the longest prompt plus the longest response."""
        return self.data.max_prompt_length + self.rollout.max_response_length

    def validate_context(self, hf_config: dict[str, Any]) -> None:
        """Checks prompt + response length against the positions the model supports under its rope scaling."""
        from megatron_sortedrl.rope import resolve_rope

        rope = resolve_rope(hf_config, dict(self.model.rope_scaling), source=f"{self.model.path}/config.json")
        if self.max_model_len > rope.max_positions:
            raise ConfigError(
                "rollout.max_response_length", self.rollout.max_response_length,
                f"at most {rope.max_positions - self.data.max_prompt_length}: data.max_prompt_length "
                f"({self.data.max_prompt_length}) + rollout.max_response_length = {self.max_model_len} tokens exceeds "
                f"the model's {rope.max_positions} positions ({rope.describe()}); {rope.suggest(self.max_model_len)}, "
                f"or lower rollout.max_response_length")

    def validate_model_shape(self, num_heads: int, num_kv_heads: int, num_layers: int) -> None:
        """Checks the trainer layout against a model's shape (also called with a real HF config)."""
        tp, pp = self.parallel.tensor_model_parallel_size, self.parallel.pipeline_model_parallel_size
        if num_heads % tp or num_kv_heads % tp:
            raise ConfigError(
                "parallel.tensor_model_parallel_size", tp,
                f"a divisor of both attention heads ({num_heads}) and key/value heads ({num_kv_heads})",
            )
        if num_layers % pp:
            raise ConfigError("parallel.pipeline_model_parallel_size", pp, f"a divisor of the number of layers ({num_layers})")
        for key in ("tensor_parallel_size", "long_round_tensor_parallel_size"):
            rtp = getattr(self.rollout, key)
            if num_heads % rtp or num_kv_heads % rtp:
                raise ConfigError(f"rollout.{key}", rtp, f"a divisor of attention heads ({num_heads}) and key/value heads ({num_kv_heads})")


# --------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Returns the validated config from a YAML file (default: configs/tiny_cpu.yaml) plus `key=value` overrides.

    The file and overrides are merged as plain data over the schema's defaults, interpolations resolved, and
    every value checked against the schema (`schema.validate`: types, sections, ranges) before the
    dataclasses are built, whose `__post_init__` then checks combinations of fields."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError("<config file>", str(path), "an existing YAML file, for example configs/tiny_cpu.yaml")
    try:
        try:
            stat = path.stat()
            file_data = copy.deepcopy(_read_yaml(str(path.resolve()), stat.st_mtime_ns, stat.st_size))
        except OmegaConfBaseException:
            raise
        except Exception as exc:  # yaml syntax errors and the like
            raise ConfigError("<config file>", str(path),
                              f"valid YAML ({type(exc).__name__}: {_first_line(exc)})") from None
        if not isinstance(file_data, dict):
            raise ConfigError("<config file>", str(path), "a YAML mapping of sections (model:, rollout:, ...)")
        data = merge(defaults(RunConfig), file_data)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError("<override>", item, "key=value, for example rollout.num_workers=2")
            _check_override_key(item.split("=", 1)[0])
            try:
                data = merge(data, OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False))
            except OmegaConfBaseException:
                raise
            except Exception as exc:  # a value that is not YAML, e.g. `key=[1,`
                raise ConfigError("<override>", item, f"key=value with a YAML value ({_first_line(exc)})") from None
        if "${" in json.dumps(data, default=str):  # interpolations (${oc.env:...}, ${logging.run_dir})
            data = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
        return build(RunConfig, validate(RunConfig, data))
    except OmegaConfBaseException as exc:
        raise _translate(exc, path) from None


@lru_cache(maxsize=16)
def _read_yaml(path: str, mtime_ns: int, size: int) -> Any:
    """A YAML file as plain data (interpolations unresolved), cached while the file is unchanged: tests and
    tools load the same recipe many times."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _check_override_key(key: str) -> None:
    """An override names a field of the schema, or a key inside a mapping field (model.rope_scaling.factor)."""
    node_cls: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        match = {f.name: f for f in fields(node_cls)}.get(part)
        if match is None:
            _raise_unknown(key)
        default = match.default_factory() if match.default_factory is not MISSING else match.default
        if is_dataclass(default):
            node_cls = type(default)
        elif isinstance(default, dict):
            return
        elif i < len(parts) - 1:
            _raise_unknown(key)
        else:
            return


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def field_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every leaf field, the help ending with the declared range if any
    ("[a positive integer (>= 1)]"); used by `config --explain` and the docs."""
    rows = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(sub):
            rows.extend(field_help(type(sub), key + "."))
        else:
            text = f.metadata.get("help", "")
            if any(f.metadata.get(k) is not None for k in RANGE_KEYS):
                text += f" [{describe(hints(cls)[f.name], f.metadata)}]"
            rows.append((key, json.dumps(sub), text))
    return rows


def _raise_unknown(key: str) -> None:
    parent, _, leaf = key.rpartition(".")
    node_cls: Any = RunConfig
    for part in parent.split(".") if parent else []:
        match = {f.name: f for f in fields(node_cls)}.get(part)
        if match is None:
            _raise_unknown(parent)
        default = match.default_factory() if match.default_factory is not MISSING else match.default
        if not is_dataclass(default):
            raise ConfigError.unknown_key(key, f"nothing ('{parent}' is a value, not a section)")
        node_cls = type(default)
    allowed = ", ".join(f.name for f in fields(node_cls))
    raise ConfigError.unknown_key(key, allowed)


def _translate(exc: OmegaConfBaseException, path: Path) -> ConfigError:
    key = getattr(exc, "full_key", None) or "<config>"
    msg = _first_line(exc)
    env = re.search(r"Environment variable '([^']+)' not found", msg)
    if env:
        return ConfigError(key, f"${{oc.env:{env.group(1)}}}",
                           f"environment variable {env.group(1)} to be set (export {env.group(1)}=... before launching)")
    if "not in" in msg or type(exc).__name__ == "ConfigKeyError":
        try:
            _raise_unknown(key)
        except ConfigError as err:
            return err
    value = getattr(exc, "value", None)
    return ConfigError(key, value, f"a value of the field's type ({msg}; set in {path} or an override)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
