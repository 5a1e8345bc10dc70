#!/usr/bin/env bash
# RL run from configs/dapo_qwen32b_128gpu.yaml on 16 node(s) x 8 GPUs. Submit from the repository checkout:
#
#   export MSRL_MODEL_DIR=/path/to/hf_checkpoint MSRL_RUN_DIR=/shared/runs/dapo_qwen32b MSRL_DATA_DIR=/path/to/data
#   sbatch slurm/dapo_qwen32b_128gpu.sh [key=value ...]           # MSRL_DRY_RUN=1 prints the layout and starts nothing
#
# Before the time limit Slurm sends USR1: the run checkpoints, exits and the job is requeued; the requeued
# job resumes from the newest complete checkpoint (checkpoint.resume=auto). See docs/cluster.md.
#SBATCH --job-name=msrl-dapo-qwen32b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

MSRL_HOME=${MSRL_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
# shellcheck source=slurm/ray_on_slurm.sh
source "$MSRL_HOME/slurm/ray_on_slurm.sh"
msrl_launch "${MSRL_CONFIG:-configs/dapo_qwen32b_128gpu.yaml}" "$@"
