#!/usr/bin/env bash
# One GPU call: train configs/eagle3.yaml for MINUTES of wall time, then copy the figures to
# $OUT. Usage (on the device machine): bash scripts/device_eagle3.sh [MINUTES] [overrides...]
set -euo pipefail
source scripts/device_setup.sh
minutes=${1:-8}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, lightning, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'datasets', datasets.__version__)" | tee -a "$OUT/gpu.txt"
set -o pipefail
python3 -m train --config configs/eagle3.yaml out_dir=/tmp/run-eagle3 \
  "trainer.max_time=00:00:$(printf %02d "$minutes"):00" trainer.enable_progress_bar=false "$@" 2>&1 | tee "$OUT/train.log"
cp /tmp/run-eagle3/predicted.json /tmp/run-eagle3/logs/metrics.csv /tmp/run-eagle3/export/config.json "$OUT/"
