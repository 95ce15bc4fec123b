#!/usr/bin/env bash
# Issue 7 on a 2-GPU machine, one call after `device_session.sh part1` (carry .whl .dev2):
# EAGLE-3 on the original ShareGPT answers for the same number of samples on 1 GPU, then with
# DDP on 2 (half the steps, batch 8 per GPU), so tokens/s per GPU, peak memory and the predicted
# tau after the same samples sit side by side, and FSDP on 2 the same way (train/fsdp.py; session
# 7's FSDP failed on the target's and drafter's mixed dtypes before the drafter was sharded alone;
# scripts/device/device_fsdp.sh checks it on one GPU first). Each run takes about
# 20 s of tokenizing, its steps, then the whole-answer held-out walk (tens of seconds): session
# 7's 170-s limit cut the 600-step 1-GPU run. Usage on the device machine:
#   STEPS=600 bash scripts/device/device_multigpu.sh
# Each run leaves $R/NAME-train.log and NAME-predicted.json; $OUT/results.tgz holds them all.
set -euo pipefail
source scripts/device/device_setup.sh
set +e
R=/tmp/results-multigpu
mkdir -p $R
steps=${STEPS:-600}
collect() { tar czf $OUT/results.tgz.$BASHPID -C /tmp results-multigpu && mv $OUT/results.tgz.$BASHPID $OUT/results.tgz; }
( while sleep 30; do collect; done ) > /dev/null 2>&1 &
trap "kill $! 2> /dev/null" EXIT
run() {  # name, devices, strategy, steps, warmup
  timeout ${RUN_LIMIT:-300} python3 -m train --config configs/eagle3.yaml out_dir=/tmp/mg-$1 trainer.devices=$2 \
    trainer.strategy=$3 trainer.max_steps=$4 trainer.max_time=null optim.schedule_by=steps optim.warmup_steps=$5 \
    data.batch_size=8 data.num_workers=2 eval.every_n_steps=1000000 trainer.enable_progress_bar=false \
    checkpoint_every_n_steps=1000000 > $R/$1-train.log 2>&1
  echo "$1: exit $?"
  cp /tmp/mg-$1/predicted.json $R/$1-predicted.json 2> /dev/null
  grep -a "predicted acceptance\|Error\|error" $R/$1-train.log | tail -3
  collect
}
date -u +'call start %H:%M:%S'
run one-gpu 1 auto $steps 100
run ddp 2 ddp $((steps / 2)) 50
run fsdp 2 fsdp $((steps / 2)) 50
for f in $R/*-predicted.json; do echo "== $f"; python3 -c "import json,sys; d=json.load(open('$f')); print(d['train_steps'], d['throughput'], round(d['predicted']['tau'], 3), d['predicted']['num_chains'])"; done
