#!/usr/bin/env bash
# Device-tool preamble: install carried wheels (pydantic...) and kvforge itself (editable, no deps).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation --no-index -e .
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
# ../shared does not travel: restore the test checkpoints next to the checkout.
mkdir -p ../shared/models && cp -r .gpu_assets/stories260K ../shared/models/ 2>/dev/null || true
cp -r .gpu_assets/tokenizers ../shared/ 2>/dev/null || true
