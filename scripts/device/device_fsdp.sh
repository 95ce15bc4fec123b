#!/usr/bin/env bash
# Issue 22 on ONE GPU, one call after `device_session.sh part1` (carry .whl .dev2): EAGLE-3
# (configs/eagle3.yaml) for the same STEPS with trainer.strategy=ddp and with trainer.strategy=fsdp
# (both trainer.devices=1, the same seed and data order, the LR schedule by steps so that time
# plays no part), then:
#   - export.check on both runs' exports, and on an export of the FSDP run's last.ckpt alone
#     (`python -m export --checkpoint`: the checkpoint written under FSDP is self-contained);
#   - the max abs difference between the two exports' tensors (bf16 noise expected);
#   - the FSDP run resumed from its last.ckpt for RESUME_STEPS more steps, and its export checked.
# Each run is cut at RUN_LIMIT seconds (the GPU is shared); the held-out walk is kept short
# (EVAL_SEQS conversations): tau here only has to agree between the two runs. Usage on the
# device machine:
#   STEPS=200 bash scripts/device/device_fsdp.sh
# $OUT/summary.txt is the printed summary; $OUT/results.tgz holds every log and predicted.json.
# EXTRA: more overrides for every run (a CPU rehearsal of this script on the tiny target, say).
set -euo pipefail
source scripts/device/device_setup.sh
set +e
R=/tmp/results-fsdp
rm -rf $R /tmp/fsdp-ddp /tmp/fsdp-fsdp /tmp/fsdp-fsdp-reexport /tmp/fsdp-fsdp-export-step*  # a repeated call starts afresh
mkdir -p $R
steps=${STEPS:-200}
more=${RESUME_STEPS:-20}
collect() { tar czf $OUT/results.tgz.$BASHPID -C /tmp results-fsdp && mv $OUT/results.tgz.$BASHPID $OUT/results.tgz; }
( while sleep 30; do collect; done ) > /dev/null 2>&1 &
trap "kill $! 2> /dev/null; collect" EXIT
exec > >(tee -a $OUT/summary.txt) 2>&1

train() {  # name, strategy, steps, extra arguments (--resume last)
  local name=$1 strategy=$2 n=$3; shift 3
  local log=$R/$name-to$n-train.log
  timeout ${RUN_LIMIT:-200} python3 -m train --config configs/eagle3.yaml out_dir=/tmp/fsdp-$name trainer.devices=1 \
    trainer.strategy=$strategy trainer.max_steps=$n trainer.max_time=null optim.schedule_by=steps \
    optim.warmup_steps=$((steps / 4)) eval.every_n_steps=1000000 eval.num_sequences=${EVAL_SEQS:-16} \
    checkpoint_every_n_steps=1000000 trainer.enable_progress_bar=false ${EXTRA:-} "$@" > $log 2>&1
  echo "$name ($strategy, to step $n): exit $?"
  cp /tmp/fsdp-$name/predicted.json $R/$name-step$n-predicted.json 2> /dev/null
  grep -a "Restored all states\|predicted acceptance\|Error\|error" $log | tail -3
  collect
}

check() {  # export folder, log name
  python3 -m export.check "$1" > $R/check-$2.log 2>&1
  echo "export.check $1: exit $? ($(tail -1 $R/check-$2.log))"
}

date -u +'call start %H:%M:%S'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
train ddp ddp $steps
train fsdp fsdp $steps
check /tmp/fsdp-ddp/export ddp
check /tmp/fsdp-fsdp/export fsdp
python3 -m export --checkpoint /tmp/fsdp-fsdp/checkpoints/last.ckpt --out /tmp/fsdp-fsdp-reexport > $R/reexport.log 2>&1
echo "export from the FSDP checkpoint alone: exit $?"
check /tmp/fsdp-fsdp-reexport fsdp-reexport
cp -r /tmp/fsdp-fsdp/export /tmp/fsdp-fsdp-export-step$steps  # the resume below rewrites it
python3 - /tmp/fsdp-ddp/export /tmp/fsdp-fsdp-export-step$steps <<'EOF'
# the two exports side by side: max abs difference per tensor, and against the tensor's scale
import sys
from safetensors.torch import load_file

a, b = (load_file(f"{d}/model.safetensors") for d in sys.argv[1:3])
print(f"tensors: {len(a)} (ddp) vs {len(b)} (fsdp); same names: {sorted(a) == sorted(b)}")
worst = 0.0
for name in sorted(set(a) & set(b)):
    x, y = a[name].float(), b[name].float()
    if x.shape != y.shape:
        print(f"  {name}: shapes differ {tuple(x.shape)} vs {tuple(y.shape)}")
        continue
    diff, scale = (x - y).abs().max().item(), x.abs().max().item()
    worst = max(worst, diff / scale if scale else diff)
    print(f"  {name}: max abs diff {diff:.3e} (max abs {scale:.3e})")
print(f"largest difference relative to its tensor's scale: {worst:.3e} "
      f"({'within' if worst < 2e-2 else 'BEYOND'} bf16 noise, 2e-2)")
EOF
for f in $R/ddp-step$steps-predicted.json $R/fsdp-step$steps-predicted.json; do
  python3 -c "import json; d=json.load(open('$f')); p=d['predicted']; print('$(basename $f)', d['train_steps'], 'steps, tau', round(p['tau'], 3), 'over', p['num_chains'], 'chains;', d['throughput'])"
done
train fsdp fsdp $((steps + more)) --resume last
check /tmp/fsdp-fsdp/export fsdp-resumed
date -u +'call end %H:%M:%S'
