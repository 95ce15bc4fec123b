#!/usr/bin/env bash
# One GPU call: train configs/eagle3.yaml for MINUTES of wall time as run NAME, then copy its
# figures to $OUT/NAME-*. Several variants side by side: call it once per variant.
# Usage (on the device machine): bash scripts/device_eagle3.sh MINUTES NAME [overrides...]
set -euo pipefail
source scripts/device_setup.sh
minutes=${1:-7}; name=${2:-eagle3}; shift 2 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, transformers, lightning, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'datasets', datasets.__version__)" >> "$OUT/gpu.txt"
# preflight: the Triton kernels training uses must match their references on this GPU
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/$name-kernels.log" 2>&1 || { tail -30 "$OUT/$name-kernels.log"; exit 1; }
python3 -m train --config configs/eagle3.yaml out_dir=/tmp/run-$name \
  "trainer.max_time=00:00:$(printf %02d "$minutes"):00" trainer.enable_progress_bar=false "$@" > "$OUT/$name-train.log" 2>&1
grep -a "predicted acceptance" "$OUT/$name-train.log" || tail -20 "$OUT/$name-train.log"
cp /tmp/run-$name/predicted.json "$OUT/$name-predicted.json"
cp /tmp/run-$name/logs/metrics.csv "$OUT/$name-metrics.csv"
