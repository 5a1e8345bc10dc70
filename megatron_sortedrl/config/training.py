"""Run config sections of the update: `parallel` (with `parallel.recompute`), `algorithm`, `trainer`, `checkpoint`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_sortedrl.config.fields import help_field
from megatron_sortedrl.errors import ConfigError


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
    ppo_mini_batch_size: int = help_field(
        "Samples per optimizer step (verl's ppo_mini_batch_size x rollout.n; slime's global batch): each harvest is "
        "trained in mini-batches of whole prompt groups, so the update size is this setting whatever the scheduling "
        "policy harvests; old log-probs are taken once per harvest, before its first step (the PPO clip then binds). "
        "A remainder smaller than one mini-batch waits for the next harvest (trained last when the data or the run "
        "ends), so every policy makes the same optimizer steps on the same data. A multiple of "
        "rollout.n_samples_per_prompt; 0: the whole harvest in one step (the update size follows the policy).",
        0, min=0)
    ppo_epochs: int = help_field(
        "Passes over each harvest's mini-batches (verl's ppo_epochs); the old log-probs stay those of the harvest's "
        "start.", 1, min=1)
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
        if self.ppo_mini_batch_size < 0:
            raise ConfigError("algorithm.ppo_mini_batch_size", self.ppo_mini_batch_size, "an integer >= 0 (0: the whole harvest)")
        if self.ppo_epochs < 1:
            raise ConfigError("algorithm.ppo_epochs", self.ppo_epochs, "an integer >= 1")
        if not self.log_ratio_clamp >= 0:
            raise ConfigError("algorithm.log_ratio_clamp", self.log_ratio_clamp, "a float >= 0 (0: no clamp)")


@dataclass
class TrainerConfig:
    total_steps: int = help_field(
        "RL steps (harvests) of the RL phase; each makes algorithm.ppo_epochs x its mini-batches optimizer steps "
        "(one with algorithm.ppo_mini_batch_size 0). The learning-rate schedule advances once per RL step, as "
        "verl's does.", 40, min=1)
    lr: float = help_field("Adam learning rate.", 1e-4, gt=0)
    lr_warmup_steps: int = help_field("RL steps (harvests) of linear learning-rate warm-up from 0.", 0, min=0)
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
        "Share of warm-start solutions cut to their answer line (`#### <answer>`; arithmetic, long_addition, "
        "column_addition, and tool_multiplication, whose cut solutions answer without calling the tool): "
        "a teacher that sometimes skips the worked steps. The model then answers some problems without working, "
        "and RL has to learn that the steps (or the tool) pay off, as reasoning RL learns to think longer (the "
        "learning-parity workload, configs/learning_cpu.yaml; the tools run, configs/tools_cpu.yaml). 0 keeps "
        "every worked solution.", 0.0, min=0, max=1)
    warmup_reset_optimizer: bool = help_field(
        "Start RL with fresh Adam moments after the warm start, as after a separate supervised job. False keeps "
        "the warm start's moments: their second moments, from supervised gradients far larger than RL's, then "
        "shrink the RL updates for hundreds of steps (Adam's beta2 = 0.999), and the first moments keep pushing "
        "the weights along the warm start's last direction while RL's gradients are zero.", True)
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
