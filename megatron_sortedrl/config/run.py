"""The whole run config (`RunConfig`: its sections and the checks across them) and how it is loaded from YAML and
`key=value` overrides, printed and explained."""

from __future__ import annotations

import copy
import json
import re
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_sortedrl.agentic.config import ToolsConfig
from megatron_sortedrl.config.cluster import ClusterConfig, LoggingConfig, PlanConfig
from megatron_sortedrl.config.fields import ANSWER_LINE_TASKS, DEFAULT_CONFIG, help_field
from megatron_sortedrl.config.model import DataConfig, ModelConfig, RewardConfig, RolloutConfig
from megatron_sortedrl.config.training import AlgorithmConfig, CheckpointConfig, ParallelConfig, TrainerConfig
from megatron_sortedrl.errors import ConfigError
from megatron_sortedrl.layout import check_layout
from megatron_sortedrl.schema import RANGE_KEYS, build, defaults, describe, hints, merge, validate
from scheduler.config import SamplingConfig, SchedulerConfig
from speculative.config import SpeculativeConfig


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
        a = self.algorithm
        if a.ppo_mini_batch_size % r.n_samples_per_prompt:
            raise ConfigError("algorithm.ppo_mini_batch_size", a.ppo_mini_batch_size,
                              f"a multiple of rollout.n_samples_per_prompt ({r.n_samples_per_prompt}): mini-batches "
                              "hold whole prompt groups")
        if self.trainer.stream and (a.ppo_mini_batch_size or a.ppo_epochs > 1):
            raise ConfigError("trainer.stream", True,
                              "false with algorithm.ppo_mini_batch_size > 0 or ppo_epochs > 1 (stream training "
                              "accumulates one optimizer step per harvest; mini-batch steps need the harvest's old "
                              "log-probs before the first one)")
        adv = a.advantage
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
        if self.cluster.colocate:
            from megatron_sortedrl.colocate.placement import check_colocated

            check_colocated(self)  # engines on the trainer's devices, block by block
        if self.trainer.stream and self.cluster.colocate:  # colocate/: the engines hold the devices in a round
            raise ConfigError("trainer.stream", True, "false with cluster.colocate=true (a colocated trainer cannot "
                              "run a backward while the engines generate on its devices; docs/cluster.md)")
        if s.policy == "async":
            check_asynchronous(self)
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
    return load_schema(RunConfig, Path(path) if path else DEFAULT_CONFIG, overrides,
                       ("<config file>", "configs/tiny_cpu.yaml", "model:, rollout:, ...", "rollout.num_workers=2"))


def load_schema(root: type, path: Path, overrides: list[str] | None, words: tuple[str, str, str, str]) -> Any:
    """`root` (a schema dataclass) from the YAML file `path` and `key=value` overrides, as `load_config` says;
    `words`: how errors name the file, an example file, its sections and an example override."""
    what, example, sections, example_override = words
    if not path.is_file():
        raise ConfigError(what, str(path), f"an existing YAML file, for example {example}")
    try:
        try:
            stat = path.stat()
            file_data = copy.deepcopy(_read_yaml(str(path.resolve()), stat.st_mtime_ns, stat.st_size))
        except OmegaConfBaseException:
            raise
        except Exception as exc:  # yaml syntax errors and the like
            raise ConfigError(what, str(path), f"valid YAML ({type(exc).__name__}: {_first_line(exc)})") from None
        if not isinstance(file_data, dict):
            raise ConfigError(what, str(path), f"a YAML mapping of sections ({sections})")
        data = merge(defaults(root), file_data)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError("<override>", item, f"key=value, for example {example_override}")
            data = merge(data, override_data(item, root))
        if "${" in json.dumps(data, default=str):  # interpolations (${oc.env:...}, ${logging.run_dir})
            data = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
        return build(root, validate(root, data))
    except OmegaConfBaseException as exc:
        raise _translate(exc, path, root) from None


@lru_cache(maxsize=16)
def _read_yaml(path: str, mtime_ns: int, size: int) -> Any:
    """A YAML file as plain data (interpolations unresolved), cached while the file is unchanged: tests and
    tools load the same recipe many times."""
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def override_data(item: str, root: type = RunConfig) -> dict[str, Any]:
    """One `key=value` override as nested plain data. The key must name a field of the schema `root` (or a key
    inside a mapping field, model.rope_scaling.factor); the value is read as YAML, except that a string field
    keeps the text as typed: `rollout.return_routed_experts=on` is the string "on", not YAML's boolean, and
    `name=1e3` stays "1e3" (and a number field refuses `on` as that text, not as `True`)."""
    key, _, text = item.partition("=")
    typ = _override_type(key, root)
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except OmegaConfBaseException:
        raise
    except Exception as exc:  # a value that is not YAML, e.g. `key=[1,`
        raise ConfigError("<override>", item, f"key=value with a YAML value ({_first_line(exc)})") from None
    node: Any = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    value = node[leaf]
    if ((typ in (str, str | None) and isinstance(value, (bool, int, float)))
            or (typ in (int, float, int | None, float | None) and isinstance(value, bool))):
        node[leaf] = text.strip()  # a number field given `on` is then refused as the text 'on' the user typed
    return data  # type: ignore[return-value]


def _override_type(key: str, root: type) -> Any:
    """The annotated type of the field `key` names under `root` (None inside a mapping field); an unknown key
    raises the one-line ConfigError naming what is allowed there."""
    node_cls: Any = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part not in {f.name for f in fields(node_cls)}:
            _raise_unknown(key, root)
        typ = hints(node_cls)[part]
        if is_dataclass(typ):
            node_cls = typ
        elif typing.get_origin(typ) is dict or typ is dict:
            return None
        elif i < len(parts) - 1:
            _raise_unknown(key, root)
        else:
            return typ
    return node_cls


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


def _raise_unknown(key: str, root: type = RunConfig) -> None:
    parent, _, leaf = key.rpartition(".")
    node_cls: Any = root
    for part in parent.split(".") if parent else []:
        match = {f.name: f for f in fields(node_cls)}.get(part)
        if match is None:
            _raise_unknown(parent, root)
        if not is_dataclass(hints(node_cls)[part]):
            raise ConfigError.unknown_key(key, f"nothing ('{parent}' is a value, not a section)")
        node_cls = hints(node_cls)[part]
    allowed = ", ".join(f.name for f in fields(node_cls))
    raise ConfigError.unknown_key(key, allowed)


def _translate(exc: OmegaConfBaseException, path: Path, root: type = RunConfig) -> ConfigError:
    key = getattr(exc, "full_key", None) or "<config>"
    msg = _first_line(exc)
    env = re.search(r"Environment variable '([^']+)' not found", msg)
    if env:
        return ConfigError(key, f"${{oc.env:{env.group(1)}}}",
                           f"environment variable {env.group(1)} to be set (export {env.group(1)}=... before launching)")
    if "not in" in msg or type(exc).__name__ == "ConfigKeyError":
        try:
            _raise_unknown(key, root)
        except ConfigError as err:
            return err
    value = getattr(exc, "value", None)
    return ConfigError(key, value, f"a value of the field's type ({msg}; set in {path} or an override)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_asynchronous(cfg) -> None:
    """What `scheduler.policy=async` (megatron_sortedrl/async_loop.py) runs with, refused in one line otherwise."""
    a, s, r = cfg.algorithm, cfg.scheduler, cfg.rollout
    refusals = [
        ("cluster.colocate", cfg.cluster.colocate, "false with scheduler.policy=async (overlap needs the engines and "
         "the trainer on GPUs of their own; colocated runs use a synchronous policy, docs/scheduler.md)"),
        ("trainer.stream", cfg.trainer.stream, "false with scheduler.policy=async (it trains mini-batches as they "
         "fill, not one streamed step per harvest)"),
        ("algorithm.ppo_epochs", a.ppo_epochs if a.ppo_epochs > 1 else 0, "1 with scheduler.policy=async (the "
         "staleness bound counts one optimizer step per mini-batch)"),
        ("sampling.dynamic", cfg.sampling.dynamic, "false with scheduler.policy=async (a filtered group would leave "
         "its admitted place in the bound empty; use a synchronous policy for DAPO's dynamic sampling)"),
        ("scheduler.layout_planner", s.layout_planner if s.layout_planner != "fixed" else "", "fixed with "
         "scheduler.policy=async (engines are not re-laid out while they generate)"),
        ("scheduler.lookahead", s.lookahead, "false with scheduler.policy=async (it is always ahead)"),
        ("tools.tools", list(cfg.tools.tools) if cfg.tools.tools else [], "empty with scheduler.policy=async (multi-turn "
         "trajectories run with the synchronous policies)"),
    ]
    for key, value, allowed in refusals:
        if value:
            raise ConfigError(key, value, allowed)
    size = a.ppo_mini_batch_size or s.update_batch_size
    if size % r.n_samples_per_prompt:
        raise ConfigError("scheduler.update_batch_size", s.update_batch_size, "a multiple of "
                          f"rollout.n_samples_per_prompt ({r.n_samples_per_prompt}): with scheduler.policy=async it "
                          "is the mini-batch when algorithm.ppo_mini_batch_size is 0")
