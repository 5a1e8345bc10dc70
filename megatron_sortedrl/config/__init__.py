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

Layout: `fields.py` (`help_field`, shared constants), one module per group of sections (`model.py`: model,
data, reward, rollout; `training.py`: parallel, algorithm, trainer, checkpoint; `cluster.py`: logging,
cluster, plan), and `run.py` (`RunConfig`, loading, printing, `--explain`). The `scheduler`, `speculative`,
`sampling` and `tools` sections live beside their packages. Import everything from here.
"""

from megatron_sortedrl.config.cluster import ClusterConfig, LoggingConfig, PlanConfig
from megatron_sortedrl.config.fields import ANSWER_LINE_TASKS, DEFAULT_CONFIG, TASKS, help_field
from megatron_sortedrl.config.model import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TinyModelConfig
from megatron_sortedrl.config.run import RunConfig, field_help, load_config, to_dict, to_yaml
from megatron_sortedrl.config.training import (AlgorithmConfig, CheckpointConfig, ParallelConfig, RecomputeConfig,
                                               TrainerConfig)
from megatron_sortedrl.errors import ConfigError

__all__ = ["ANSWER_LINE_TASKS", "DEFAULT_CONFIG", "TASKS", "AlgorithmConfig", "CheckpointConfig", "ClusterConfig", "ConfigError",
           "DataConfig", "LoggingConfig", "ModelConfig", "ParallelConfig", "PlanConfig", "RecomputeConfig",
           "RewardConfig", "RolloutConfig", "RunConfig", "TinyModelConfig", "TrainerConfig", "field_help",
           "help_field", "load_config", "to_dict", "to_yaml"]
