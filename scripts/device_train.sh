#!/usr/bin/env bash
# One GPU call: train a recipe for MINUTES of wall time as run NAME, then copy its figures to
# $OUT/NAME-*. Usage (on the device machine): bash scripts/device_train.sh CONFIG MINUTES NAME [overrides...]
# e.g. bash scripts/device_train.sh configs/dflash.yaml 8 dflash data.dataset=/tmp/regen/conversations.jsonl
set -euo pipefail
source scripts/device_setup.sh
config=$1; minutes=$2; name=$3; shift 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py > "$OUT/$name-kernels.log" 2>&1 || { tail -30 "$OUT/$name-kernels.log"; exit 1; }
python3 -m train --config "$config" out_dir=/tmp/run-$name \
  "trainer.max_time=00:00:$(printf %02d "$minutes"):00" trainer.enable_progress_bar=false "$@" > "$OUT/$name-train.log" 2>&1 || true
grep -a "predicted acceptance\|perplexity" "$OUT/$name-train.log" || tail -20 "$OUT/$name-train.log"
cp /tmp/run-$name/predicted.json "$OUT/$name-predicted.json" 2>/dev/null || true
cp /tmp/run-$name/logs/metrics.csv "$OUT/$name-metrics.csv" 2>/dev/null || true
