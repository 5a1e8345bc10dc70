#!/usr/bin/env bash
# RL run from configs/qwen7b_colocated_8gpu.yaml on 1 node x 8 GPUs, trainer and engines colocated. Submit from the repository checkout:
#
#   export MSRL_MODEL_DIR=/path/to/hf_checkpoint MSRL_RUN_DIR=/shared/runs/qwen7b_colocated MSRL_DATA_DIR=/path/to/data
#   sbatch slurm/qwen7b_colocated_8gpu.sh [key=value ...]           # MSRL_DRY_RUN=1 prints the layout and starts nothing
#
# Before the time limit Slurm sends USR1: the run checkpoints, exits and the job is requeued; the requeued
# job resumes from the newest complete checkpoint (checkpoint.resume=auto). See docs/cluster.md.
#SBATCH --job-name=msrl-qwen7b-colo
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

MSRL_HOME=${MSRL_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
# shellcheck source=slurm/ray_on_slurm.sh
source "$MSRL_HOME/slurm/ray_on_slurm.sh"
msrl_launch "${MSRL_CONFIG:-configs/qwen7b_colocated_8gpu.yaml}" "$@"
