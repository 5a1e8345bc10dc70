"""Run config sections of the model and what it is trained on: `model`, `data`, `reward`, `rollout`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_sortedrl.config.fields import TASKS, help_field
from megatron_sortedrl.errors import ConfigError


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
