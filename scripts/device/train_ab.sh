#!/usr/bin/env bash
# Training speed of checkouts side by side, one after another on an otherwise idle GPU (the
# training counterpart of ab_profile.sh). On the device machine, after `source
# scripts/device/device_setup.sh` (device_session.sh train-ab does that and finds the data):
#   DATA=/tmp/regen/conversations.jsonl bash scripts/device/train_ab.sh STEPS old=@.ab/old new= old2=@.ab/old new2=
# Each variant trains configs/eagle3.yaml for STEPS steps: on DATA, a file of conversations, as part2
# does (16 a batch); with no DATA, on the recipe's own data as written (ShareGPT's original answers,
# 4 a batch: what `train` runs). NAME= runs this checkout, NAME=@DIR an older one carried beside it (`mkdir -p
# .ab/old && git archive COMMIT | tar -x -C .ab/old`; carry .ab, which git ignores). Each prints
# its steps a second over the training loop alone (fit minus the final walk: one clock that every
# version has, whatever its own tokens/s meter measured) and that meter's tokens/s. Logs land in
# LOGS (default /tmp/results) as ab-NAME.log, runs in RUNS_DIR (default /tmp) as ab-NAME.
# TRAIN_ARGS: more overrides, after these (the tests run it on the tiny target).
set -u
steps=$1; shift
# absolute: each variant runs from its own folder
logs=$(realpath -m "${LOGS:-/tmp/results}") runs=$(realpath -m "${RUNS_DIR:-/tmp}")
data=()
if [ -n "${DATA:-}" ]; then
  DATA=$(realpath -m "$DATA")
  data=(data.batch_size=16 data.dataset=$DATA "eval.datasets=[$DATA]")
fi
mkdir -p "$logs"
for spec in "$@"; do
  name=${spec%%=*}; body=${spec#*=}; dir=.
  case $body in @*) dir=${body#@} ;; esac
  rm -rf "$runs/ab-$name"
  (cd "$dir" && PYTHONPATH=/tmp/site:. python3 -m train --config configs/eagle3.yaml out_dir="$runs/ab-$name" \
    trainer.max_steps=$steps checkpoint_every_n_steps=1000000 data.num_workers=1 "${data[@]}" \
    eval.num_sequences=4 trainer.enable_progress_bar=false ${TRAIN_ARGS:-} > "$logs/ab-$name.log" 2>&1)
  python3 - "$name" "$runs/ab-$name/predicted.json" <<'PY'
import json, sys
name, path = sys.argv[1:]
try:
    d = json.load(open(path))
except OSError:
    print(f"{name}: no predicted.json (see its log)"); sys.exit()
loop = d["fit_seconds"] - sum(d.get("walk_seconds", {}).values())
print(f"{name}: {d['train_steps']} steps, {d['train_steps'] / loop:.2f} steps/s over the loop ({loop:.1f} s), "
      f"meter {d['throughput'].get('tokens_per_s')} tokens/s, peak {d['throughput'].get('peak_gpu_memory_gib')} GiB")
PY
done
