#!/usr/bin/env bash
# One device session in a few calls (the GPU machine keeps /tmp while warm, ~30 s between calls;
# trainings started with setsid run on between calls). Usage on the device machine:
#   bash scripts/device_session.sh part1              # carry .whl .dev1: first half of the target, decode profile
#   bash scripts/device_session.sh part2 MINUTES      # carry .whl .dev2: regeneration, start every recipe
#   bash scripts/device_session.sh wait SECONDS       # wait for the trainings (at most SECONDS), collect
#   bash scripts/device_session.sh bench              # runtime side by side on the zoo target (GPU otherwise idle)
#   bash scripts/device_session.sh validate           # validation of the trained exports, collect
#   bash scripts/device_session.sh final              # stop trainings, bench alone, then validate (VAL_SECONDS each)
# Every call leaves $OUT/results.tgz (logs, predicted.json, metrics, reports: one file, since at
# most 8 files come back) and prints a summary.
set -euo pipefail
source scripts/device_setup.sh
set +e
what=$1; shift
R=/tmp/results
mkdir -p $R
REGEN=/tmp/regen/conversations.jsonl
# recipe:run-name:data — all on the regenerated ShareGPT, one EAGLE-3 on the original answers.
# RUNS="eagle3:eagle3:regen" bash scripts/device_session.sh part2 14 trains one recipe alone.
RUNS=${RUNS:-"eagle3:eagle3:regen eagle3:eagle3-orig:orig eagle1:eagle1:regen medusa1:medusa1:regen medusa2:medusa2:regen
dflash:dflash:regen mtp:mtp:regen mtp-joint:mtp-joint:regen"}

collect() {
  for d in /tmp/run-*; do
    [ -d "$d" ] || continue
    n=${d#/tmp/run-}
    cp "$d/predicted.json" "$R/$n-predicted.json" 2>/dev/null
    cp "$d/logs/metrics.csv" "$R/$n-metrics.csv" 2>/dev/null
  done
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader > $R/gpu.txt
  tar czf $OUT/results.tgz -C /tmp results
}

case $what in
part1)
  python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3
  python3 scripts/profile_decode.py --out $R 2>&1 | grep -v -i warn
  ;;
part2)
  minutes=$1
  python3 -m data.regenerate --dataset sharegpt --out /tmp/regen --batch-size 512 --max-minutes 2.5 2>&1 | tail -3 | tee $R/regen.log
  cp /tmp/regen/regenerate.json $R/ 2>/dev/null
  for spec in $RUNS; do
    IFS=: read recipe name data <<< "$spec"
    pgrep -f "out_dir=/tmp/run-$name " > /dev/null && continue  # already training (a repeated call)
    if [ "$data" = regen ]; then ds=(data.dataset=$REGEN "eval.datasets=[$REGEN, sharegpt]"); else ds=("eval.datasets=[sharegpt, $REGEN]"); fi
    setsid nohup python3 -m train --config configs/$recipe.yaml out_dir=/tmp/run-$name \
      "trainer.max_time=00:00:$(printf %02d "$minutes"):00" trainer.enable_progress_bar=false data.num_workers=1 \
      optim.schedule_steps=2000 eval.every_n_steps=1000 "${ds[@]}" > $R/$name-train.log 2>&1 < /dev/null &
    sleep 2
  done
  sleep 30
  tail -n 2 $R/*-train.log
  collect
  ;;
wait)
  limit=$1; t0=$SECONDS
  while pgrep -f "python3 -m train" > /dev/null && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
  for f in $R/*-train.log; do echo "== $f"; grep -a "predicted acceptance\|perplexity\|Error\|error:" "$f" | tail -4; done
  collect
  ;;
bench)
  python3 -m inference.bench --num-prompts 20 --max-new-tokens 256 -k 4 --out $R/bench 2>&1 | grep -v -i "warn\|Loading weights" | tail -25
  collect
  ;;
final | validate)
  # final: the last call of a session: stop what is still training, bench alone, then validate
  # in the time left (VAL_SECONDS each). validate: only the validations.
  if [ "$what" = final ]; then
    t0=$SECONDS
    while pgrep -f "python3 -m train" > /dev/null && [ $((SECONDS - t0)) -lt 45 ]; do sleep 5; done
    pkill -f "python3 -m train"; sleep 3
    collect
    python3 -m inference.bench --num-prompts 20 --max-new-tokens 256 -k 4 --out $R/bench 2>&1 | grep -v -i "warn\|Loading weights" | tail -14
    collect
  fi
  # T = 0 for each trained export on mt-bench (both turns), T = 1 standard and block for EAGLE-3
  # and DFlash; all in parallel (each is bound by its host loop, not by the GPU)
  V=(--dataset mt-bench --num-prompts ${VAL_PROMPTS:-20} --max-new-tokens 256)
  vt() { name=$1; shift; [ -d /tmp/run-${name%%@*}/export ] || return 0
         timeout ${VAL_SECONDS:-540} python3 -m inference.validate --drafter /tmp/run-${name%%@*}/export "${V[@]}" \
         --out $R/val-$name "$@" > $R/val-$name.log 2>&1; }
  vt eagle3 --reference ngram --reference suffix &
  for n in eagle3-orig dflash medusa1 mtp eagle1 mtp-joint medusa2; do vt $n & done
  vt eagle3@t1-standard --temperature 1 --verification standard &
  vt eagle3@t1-block --temperature 1 --verification block &
  vt dflash@t1-standard --temperature 1 --verification standard &
  vt dflash@t1-block --temperature 1 --verification block &
  wait
  for f in $R/val-*.log; do echo "== $f"; grep -a "tau predicted\|runtime gap\|reference\|error" "$f" | head -4; done
  collect
  ;;
esac
