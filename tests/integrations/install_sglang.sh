#!/usr/bin/env bash
# Install the sglang package the HiCache backend tests (tests/integrations/sglang/test_sglang.py)
# run against, into an existing virtual environment:
#
#   tests/integrations/install_sglang.sh [PYTHON]     (default: the active python)
#
# SGLang's engine needs a GPU; its HiCache storage interface (hicache_storage.py) and the
# backend factory import on CPU.  Everything is installed with --no-deps: sglang's own
# requirements pin torch==2.14.1 and CUDA packages, which must not replace the CPU torch.
# The list below is what `import sglang.srt.mem_cache.storage.backend_factory` needs,
# found by trying; versions are pinned where sglang 0.5.23 pins them.
set -euo pipefail
py="${1:-python}"
"$py" -m pip install -q --no-deps sglang==0.5.23
"$py" -m pip install -q --no-deps orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 \
    triton==3.9.0 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 \
    pydantic_core==2.50.5 typing_inspection==0.4.5 pyzmq==27.3.0 tqdm==4.70.1 \
    ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 \
    propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 \
    transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 pyyaml==6.0.4 \
    filelock==4.3.1 regex==2026.11.19 huggingface_hub==2.4.0 httpx2==2.16.2 \
    httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0
# SGLang's own HiCache controller (tests/integrations/sglang/controller.py) imports these
# too; pinned to the versions its tests ran with (sglang pins apache-tvm-ffi 0.1.11,
# compressed-tensors 0.18.0 and sentencepiece 0.2.1 for its GPU build; only the import
# is needed here).  torchvision, which two of its model configs import, has no CPU build
# on PyPI: the tests stand in for it while they import the controller.
"$py" -m pip install -q --no-deps apache-tvm-ffi==0.1.15.post2 dill==0.4.1 \
    sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 annotated-types==0.8.0 \
    gguf==0.19.0
"$py" -c "import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.hicache_storage; import torch; print('sglang HiCache storage interface imports; torch', torch.__version__)"
