"""Run config sections of the machines and the run's records: `logging`, `cluster`, `plan`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_sortedrl.config.fields import help_field
from megatron_sortedrl.errors import ConfigError


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
