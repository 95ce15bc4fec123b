#!/usr/bin/env bash
# One device session in a few calls (the GPU machine keeps /tmp while warm, ~30 s between calls;
# trainings started with setsid run on between calls). Usage on the device machine:
#   bash scripts/device/device_session.sh part1              # carry .whl .dev1: first half of the target (PROFILE=1: decode profile, kernel tests)
#   bash scripts/device/device_session.sh part2 MINUTES      # carry .whl .dev2: regeneration (REGEN_MINUTES, more of a carried
#                                                     # set), start the recipes in RUNS
#   bash scripts/device/device_session.sh fresh MINUTES      # carry .whl .dev2: held-out answers for the promises (ShareGPT at T = 0
#                                                     # and 1, HumanEval's half), then EAGLE-3, DFlash and MTP on their recipes
#   bash scripts/device/device_session.sh train MINUTES      # carry .whl .dev2 (after part1): the recipes in RUNS_TRAIN as written
#                                                     # (default EAGLE-3 alone) on the original answers, nothing regenerated
#                                                     # (then `GPU_TESTS=0 ... wait`: the GPU to the training alone)
#   bash scripts/device/device_session.sh tree-promise NAME  # a copy of a `fresh` EAGLE-3 export promising trees alone (TREES)
#   bash scripts/device/device_session.sh wait SECONDS       # wait for the trainings (at most SECONDS), collect (first: the CUDA regression
#                                                     # tests, beside the trainings; GPU_TESTS=0: none, for a recipe trained alone);
#                                                     # BRING=NAME...: each finished export packed into $OUT as `bring` does
#                                                     # (BRING_MID=1: one still training, its last checkpoint exported
#                                                     # and packed as NAME-mid-parts)
# A machine idle for ~30 s between calls is given back with all of /tmp (a drafter trained for 14
# minutes is lost between a `wait` and a `bench` sent apart): chain what must meet in one call,
# e.g. `BRING=eagle3 bash scripts/device/device_session.sh wait 480; BENCH_ONLY=eagle3 bash scripts/device/device_session.sh bench`.
# Gaps between calls are not always short (45 s to minutes, and the lease can end between two
# calls): a training that must
# come back ends inside the call that starts it,
# `part2 8; GPU_TESTS=0 BRING=eagle3 bash scripts/device/device_session.sh wait 540` in one call (<600 s),
# and its export is here whatever the next gap does (bench it later: part1, then carry its parts)
#   bash scripts/device/device_session.sh bench              # runtime side by side on the zoo target, every trained export (GPU otherwise idle);
#                                                     # TUNE_ATTENTION=1: scripts/bench_attention.py first, its best variant exported
#                                                     # (ATTN_ARGS: its geometry, e.g. the bench's own cache and roots)
#   bash scripts/device/device_session.sh validate           # validation of the trained exports, collect (ALONGSIDE: short runs meanwhile)
#   bash scripts/device/device_session.sh serve SPEC...      # NAME[@t1-standard|@t1-block|@humaneval|@tree-D-K-N]: those
#                                                     # validations alone, in parallel
#   bash scripts/device/device_session.sh final              # stop trainings, bench alone, then validate (VAL_MINUTES each)
#   bash scripts/device/device_session.sh bring NAME...      # /tmp/run-NAME/export packed into $OUT/NAME-parts (no target
#                                                     # tensors, parts <= 15 MiB: an EAGLE-3 export is 4 files, 29 MB)
#   bash scripts/device/device_session.sh fsdp [STEPS]       # carry .dev2 (after part1): configs/eagle3.yaml plain and with
#                                                     # trainer.strategy=fsdp, STEPS steps each (default 40) on the
#                                                     # carried answers, both exported; FSDP's export checked, resumed
#                                                     # STEPS/2 more and exported again; the exports compared (issue 22)
#   bash scripts/device/device_session.sh promise NAME...    # carry .dev2: each unpacked export's promise made again for
#                                                     # answers served up to 256 tokens (python -m train.promise),
#                                                     # at T = 1 on the held-out answers sampled at T = 1 (SAMPLED=1),
#                                                     # for draft trees too with TREES="[[4,4,24]]" (EAGLE-3)
#   bash scripts/device/device_session.sh profile-tree       # once the target is whole (its graphed test loads it): the tree
#                                                     # kernels' GPU tests, the graphed tree test, the tree-attention
#                                                     # variants (scripts/bench_attention.py), then chain and tree steps
#                                                     # side by side on random weights of the real shapes (PROFILE_TREES),
#                                                     # each traced kernel by kernel (eager trees where the graph test fails)
#   bash scripts/device/device_session.sh train-ab STEPS NAME=[@DIR]...  # training speed side by side (after part1;
#                                                     # carry .whl .dev2, and .ab for older checkouts)
#   bash scripts/device/device_session.sh unpack             # every carried .dev*/NAME-parts back into /tmp/run-NAME/export
#                                                     # (staged here by scripts/device/drafter_parts.py stage; run it in every
#                                                     # call that carries parts: they are gathered in /tmp between calls)
# (a drafter trained in one session can be benched in a later one: copy $OUT/NAME-parts into an
# ignored .devN folder here and carry it; scripts/device/drafter_parts.py checks every tensor on the way)
# Every call leaves $OUT/results.tgz (logs, predicted.json, metrics, reports: one file, since at
# most 8 files come back) and prints a summary. Several GPUs: regeneration runs two shards per GPU,
# each run names its GPU in RUNS, validations take the GPUs in turn.
set -euo pipefail
source scripts/device/device_setup.sh
set +e
what=$1; shift
R=/tmp/results
mkdir -p $R
REGEN=/tmp/regen/conversations.jsonl
# held-out answers for the promises (`fresh`): ShareGPT's held-out questions answered greedily and
# sampled at T = 1, and HumanEval's held-out half answered greedily
HELD_T0=/tmp/held-t0/conversations.jsonl HELD_T1=/tmp/held-t1/conversations.jsonl HELD_HE=/tmp/held-he/conversations.jsonl
NGPU=$(nvidia-smi -L | wc -l)
# recipe:run-name:data:gpu[:override,override...]. One GPU: all share it. Two GPUs: EAGLE-3 on
# regenerated answers alone on GPU 0 and EAGLE-3 on the original answers alone on GPU 1 (issue
# 6: the same budget each, a whole H200). Batches hold about the same tokens: 16 regenerated
# conversations (they are short), 8 original ones. The LR schedule follows the time (max_steps
# only far beyond it). Held-out walks every EVAL_EVERY steps (default: only the final one; they
# walk whole answers: four trainings sharing the GPU spend minutes in each walk, and a final walk
# can outlast the device time). RUNS=shared compares all eight
# recipes (GPU 0: EAGLE-3, EAGLE-3 on original answers and DFlash, a third each;
# GPU 1: EAGLE-1, Medusa-1 and -2, MTP frozen and joint, a fifth each).
SHARED_RUNS="eagle3:eagle3:regen:0:data.batch_size=16 eagle3:eagle3-orig:orig:0:data.batch_size=8 dflash:dflash:regen:0:data.batch_size=16
eagle1:eagle1:regen:1 medusa1:medusa1:regen:1 medusa2:medusa2:regen:1 mtp:mtp:regen:1 mtp-joint:mtp-joint:regen:1"
if [ "$NGPU" -ge 2 ]; then
  DEFAULT_RUNS="eagle3:eagle3:regen:0:data.batch_size=16 eagle3:eagle3-orig:orig:1:data.batch_size=8"
else
  DEFAULT_RUNS="eagle3:eagle3:regen:0 eagle3:eagle3-orig:orig:0 eagle1:eagle1:regen:0 medusa1:medusa1:regen:0 medusa2:medusa2:regen:0
dflash:dflash:regen:0 mtp:mtp:regen:0 mtp-joint:mtp-joint:regen:0"
fi
case ${RUNS:-} in
  shared) RUNS=$SHARED_RUNS ;;
  "") RUNS=$DEFAULT_RUNS ;;
esac

start_runs() {  # RUNS-style specs, minutes each
  for spec in $1; do
    IFS=: read recipe name data gpu extra <<< "$spec"
    pgrep -f "out_dir=/tmp/run-$name " > /dev/null && continue  # already training (a repeated call)
    # one held-out set, EVAL_SEQS conversations of it: two sets of 32 walked greedy and at T = 1
    # ran past 6 minutes for drafters sharing the GPU (stopped before their exports); 16 take about
    # 30 s but promised 11-16 % more than MT-bench measured: 64, the recipes' own default
    case $data in
      regen) ds=(data.dataset=$REGEN "eval.datasets=[$REGEN]") ;;
      # the recipe's own data (original ShareGPT answers); promised on the target's answers to the
      # held-out questions (greedy, and sampled at T = 1) and to HumanEval's held-out half (`fresh`)
      held) ds=(data.dataset=sharegpt "eval.datasets=[$HELD_T0, $HELD_HE]" "eval.sampled_answers={1: $HELD_T1}") ;;
      *) ds=("eval.datasets=[sharegpt]") ;;
    esac
    ds+=(eval.num_sequences=${EVAL_SEQS:-64})
    [ -n "${TREES:-}" ] && [[ $recipe == eagle3 ]] && ds+=("eval.trees=$TREES")  # the tree promise (EAGLE-3 drafts trees)
    # minutes may be fractional (7.5: what one call holds beside the startup, final walk and export)
    secs=$(awk -v m="$2" 'BEGIN { printf "%d", m * 60 }')
    CUDA_VISIBLE_DEVICES=${gpu:-0} setsid nohup python3 -m train --config configs/$recipe.yaml out_dir=/tmp/run-$name \
      "trainer.max_time=00:$(printf %02d:%02d:%02d $((secs / 3600)) $((secs % 3600 / 60)) $((secs % 60)))" trainer.max_steps=1000000 trainer.enable_progress_bar=false \
      data.num_workers=1 eval.every_n_steps=${EVAL_EVERY:-1000000} "${ds[@]}" ${extra//,/ } > $R/$name-train.log 2>&1 < /dev/null &
    pids+=($!)
    sleep 2
  done
}

carried_regen() {  # the regenerated answers carried in a .devN folder, unpacked once into $REGEN
  [ -f $REGEN ] && return
  mkdir -p /tmp/regen
  gunzip -c $(ls .dev*/regen-conversations.jsonl.gz | head -1) > $REGEN
}

train_summary() {  # the last figures each training printed (peak memory: in its predicted.json)
  for f in $R/*-train.log; do echo "== $f"; grep -a "predicted acceptance\|perplexity\|Error\|error:" "$f" | tail -4; done
}

collect() {
  for d in /tmp/run-*; do
    [ -d "$d" ] || continue
    n=${d#/tmp/run-}
    cp "$d/predicted.json" "$R/$n-predicted.json" 2>/dev/null
    cp "$d/logs/metrics.csv" "$R/$n-metrics.csv" 2>/dev/null
  done
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader > $R/gpu.txt
  tar czf $OUT/results.tgz.$BASHPID -C /tmp results && mv $OUT/results.tgz.$BASHPID $OUT/results.tgz
}
pids=()  # background jobs of this call that it waits for
# What is under $OUT comes back even when a call outruns its limit: collect every 30 s, so a
# call cut short still returns what it had (collecting only at the end loses a whole call)
( while sleep 30; do collect; done ) > /dev/null 2>&1 &
collector=$!
trap 'kill $collector 2> /dev/null' EXIT

# Validations (`vt NAME[@label] ARGS`, `bg` the same in the background): each serves questions for
# VAL_MINUTES (spread over the categories), then replays and reports on those; two CPU threads
# each, since a dozen run at once. timeout is only a backstop. VAL_BATCH questions are served
# together (VAL_BATCH=1: one at a time)
V=(--dataset mt-bench --num-prompts ${VAL_PROMPTS:-80} --max-new-tokens 256 --max-minutes ${VAL_MINUTES:-3}
   --batch-size ${VAL_BATCH:-16} --tolerance ${VAL_TOLERANCE:-0.05})
vt() { name=$1; shift; [ -d /tmp/run-${name%%@*}/export ] || return 0
       OMP_NUM_THREADS=2 timeout $(( ${VAL_MINUTES:-3} * 60 + 300 )) python3 -m inference.validate \
       --drafter /tmp/run-${name%%@*}/export "${V[@]}" --out $R/val-$name "$@" > $R/val-$name.log 2>&1; }
# --promise-set for HumanEval when the export promises on HumanEval's held-out half (`fresh`)
he_promise() { grep -qF "$HELD_HE" /tmp/run-$1/export/draftsmith.json 2> /dev/null && echo --promise-set $HELD_HE; }
n_vt=0  # the GPUs in turn (counted here: a background job's variables do not come back)
bg() { CUDA_VISIBLE_DEVICES=$((n_vt % NGPU)) vt "$@" & pids+=($!); n_vt=$((n_vt + 1)); }
val_summary() { for f in $R/val-*.log; do echo "== $f"; grep -a "tau predicted\|Turns:\|gap\|reference\|error" "$f" | head -5; done; }

date -u +'call start %H:%M:%S'
case $what in
part1)
  nvidia-smi -L
  if [ "${PROFILE:-0}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3
    # the speculative step's split at a known acceptance, random weights of the real shapes
    python3 scripts/profile_spec.py ${TRACE:+--trace} --out $R 2>&1 | grep -v -i "warn\|Loading weights"
  fi
  if [ "${MPS:-0}" = 1 ]; then
    # CUDA MPS: kernels of several processes run side by side instead of time-sliced (one
    # training's small kernels leave most of the GPU idle; time-slicing made peers wait for each
    # other's slices). Probed with two processes; left running for the trainings, stopped by bench.
    # default pipe directory: every later process on the machine connects to it by itself
    nvidia-cuda-mps-control -d && sleep 1
    probe='import torch; a = torch.randn(4096, 4096, device="cuda"); [a @ a for _ in range(200)]; torch.cuda.synchronize(); print("ok")'
    python3 -c "$probe" > /tmp/mps1 2>&1 &
    probe_pid=$!
    python3 -c "$probe" > /tmp/mps2 2>&1
    wait $probe_pid  # (a bare wait would wait for the collector too: forever)
    if grep -q ok /tmp/mps1 && grep -q ok /tmp/mps2; then
      echo "MPS: on"; touch /tmp/mps-on
    else
      echo "MPS: failed, off"; tail -3 /tmp/mps1 /tmp/mps2; echo quit | nvidia-cuda-mps-control
    fi
  fi
  ;;
part2)
  minutes=$1
  mkdir -p /tmp/regen
  carried=()
  found=$(ls .dev*/regen-conversations.jsonl.gz 2> /dev/null | head -1)
  if [ -n "$found" ]; then
    # an earlier session's regenerated answers, carried in any .devN (scripts/device/device_stage.sh REGEN_FROM=...)
    gunzip -c "$found" > /tmp/regen/carried.jsonl
    echo "regenerated answers carried: $(wc -l < /tmp/regen/carried.jsonl) conversations"
    carried=(--continue-from /tmp/regen/carried.jsonl)
  fi
  # REGEN_MINUTES of regeneration (default: 2.5 with nothing carried, none with answers carried;
  # with both, the new answers are of conversations the carried set lacks: more data, not the
  # same again). REGEN_SHARDS processes (default two per GPU; under MPS they run side by side).
  regen_minutes=${REGEN_MINUTES:-$([ ${#carried[@]} -gt 0 ] && echo 0 || echo 2.5)}
  if [ "$regen_minutes" = 0 ]; then
    [ ${#carried[@]} -gt 0 ] && cp /tmp/regen/carried.jsonl $REGEN || echo "error: REGEN_MINUTES=0 and no regenerated answers carried"
  else
    nshard=${REGEN_SHARDS:-$((2 * NGPU))}
    # 512 conversations a batch for two shards per GPU, fewer for more (four shards on one H200
    # held 40-55 GiB each and ran out of memory; regeneration releases each batch's caches and
    # graphs, and answers a batch that still runs out in two halves)
    per_gpu=$(( (nshard + NGPU - 1) / NGPU ))
    regen_batch=$(( 1024 / per_gpu < 512 ? 1024 / per_gpu : 512 ))
    for i in $(seq 0 $((nshard - 1))); do
      CUDA_VISIBLE_DEVICES=$((i % NGPU)) python3 -m inference.regenerate --dataset sharegpt --out /tmp/regen/s$i \
        --shard $i/$nshard --batch-size $regen_batch --max-minutes $regen_minutes "${carried[@]}" > $R/regen-$i.log 2>&1 &
      regen_pids+=($!)
    done
    failed=0
    for pid in "${regen_pids[@]}"; do wait $pid || failed=1; done
    [ $failed = 1 ] && { echo "a regeneration shard failed:"; grep -a -h "Error\|error" $R/regen-*.log | head -3; }
    # each shard wrote its part of the carried answers before answering anything: the shards'
    # files hold them all, and whatever a shard added before it failed
    cat /tmp/regen/s*/conversations.jsonl > $REGEN
    if [ ${#carried[@]} -gt 0 ] && [ $(wc -l < $REGEN) -lt $(wc -l < /tmp/regen/carried.jsonl) ]; then
      echo "fewer conversations than were carried: training on the carried answers alone"  # never less
      cp /tmp/regen/carried.jsonl $REGEN
    fi
    grep -a -h "wrote\|error\|already regenerated" $R/regen-*.log | tee $R/regen.log
    echo "regenerated answers now: $(wc -l < $REGEN) conversations"
    cp /tmp/regen/s0/regenerate.json $R/ 2>/dev/null
    gzip -c $REGEN > $OUT/regen-conversations.jsonl.gz  # the data itself comes back too (~2 MB per 5,000)
  fi
  start_runs "$RUNS" "$minutes"
  sleep 30
  tail -n 2 $R/*-train.log
  collect
  ;;
fresh)  # MINUTES: drafters from nothing (carry .dev2, after part1): the held-out answers the promises
  # walk, then EAGLE-3, DFlash and MTP on their recipes as written, side by side for MINUTES, each
  # promising on all held-out questions (EVAL_SEQS, default 256) at T = 0 and 1 and on HumanEval's
  # held-out half (TREES="[[4,4,24]]": EAGLE-3 on draft trees too; final walks with trees can
  # outlast the device time: `tree-promise eagle3` makes the tree promise later)
  minutes=$1
  python3 -m inference.regenerate --dataset sharegpt --heldout-only 0.02 --out ${HELD_T0%/*} --batch-size 512 > $R/held-t0.log 2>&1 &
  regen_pids=($!)
  python3 -m inference.regenerate --dataset sharegpt --heldout-only 0.02 --temperature 1 --out ${HELD_T1%/*} --batch-size 512 \
    > $R/held-t1.log 2>&1 &
  regen_pids+=($!)
  python3 -m inference.regenerate --dataset humaneval --heldout-only 0.5 --out ${HELD_HE%/*} --batch-size 256 > $R/held-he.log 2>&1
  for pid in "${regen_pids[@]}"; do wait $pid; done
  grep -a -h "wrote\|error\|already" $R/held-*.log
  for f in $HELD_T0 $HELD_T1 $HELD_HE; do gzip -c $f > $OUT/$(basename ${f%/*}).jsonl.gz; done  # they come back too
  EVAL_SEQS=${EVAL_SEQS:-256} TREES=${TREES:-} start_runs "${RUNS_FRESH:-eagle3:eagle3:held:0 dflash:dflash:held:0 mtp:mtp:held:0}" "$minutes"
  sleep 45
  tail -n 2 $R/*-train.log
  collect
  ;;
train)  # MINUTES: the recipes of RUNS_TRAIN as written on the original ShareGPT answers, promising on its
  # held-out questions' original answers (no regeneration, no held-out answers made first: `fresh` makes those)
  start_runs "${RUNS_TRAIN:-eagle3:eagle3:orig:0}" "$1"
  sleep 30
  tail -n 2 $R/*-train.log
  collect
  ;;
wait)
  limit=$1; t0=$SECONDS
  # once, while the trainings run (the target is whole only after part2): every GPU-only test
  # (graphed device loop against eager, CUDA graph steps, the batched-serving regression).
  # GPU_TESTS=0: none. They share the GPU with the trainings for ~5 minutes: the recipe's EAGLE-3
  # (`train 14`) took 7,667 steps beside them against 9,500 alone, and benched at chain tau 2.200
  # against 2.364: a drafter meant to be the recipe's trains alone
  if [ ! -f /tmp/regression-checked ] && [ "${GPU_TESTS:-1}" != 0 ]; then
    # (FSDP's one-GPU case, issue 22's, left to `fsdp` calls)
    python3 -m pytest -q -p no:cacheprovider -m gpu -rA -k "not fsdp" tests/ > /tmp/gpu-tests.log 2>&1
    grep -a "PASSED\|FAILED\|ERROR\|passed\|failed" /tmp/gpu-tests.log | tail -12 | tee $R/regression.log
    tail -c 200000 /tmp/gpu-tests.log > $R/gpu-tests.log  # a failure's traceback comes back too
    python3 -m pytest -q -p no:cacheprovider tests/test_eagle3_runtime.py -k finishing 2>&1 | tail -2 | tee -a $R/regression.log
    # the device loop through every kernel (the kernels' CUDA builds) against its torch path
    python3 -m pytest -q -p no:cacheprovider tests/test_spec_loop.py tests/test_kernels.py tests/test_chain_kernels.py tests/test_tree_attention.py -k "kernel or tree" 2>&1 | tail -2 | tee -a $R/regression.log
    # the tree's own kernels (head top-k, selection, bookkeeping and cache moves) on CUDA
    python3 -m pytest -q -p no:cacheprovider tests/test_lm_head_topk.py tests/test_tree_select.py tests/test_tree_accept.py 2>&1 | tail -2 | tee -a $R/regression.log
    touch /tmp/regression-checked
  fi
  while pgrep -f "^python3 -m train " > /dev/null && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
  train_summary
  for name in ${BRING:-}; do  # the exports come back as parts once written: a lost machine keeps nothing
    if pgrep -f "out_dir=/tmp/run-$name " > /dev/null; then
      # BRING_MID=1: a training that spans calls sends its latest checkpoint back, exported, as
      # NAME-mid-parts (mid-schedule, so weaker than the finished one: what a lost machine leaves)
      if [ "${BRING_MID:-0}" = 1 ] && [ -f /tmp/run-$name/checkpoints/last.ckpt ]; then
        rm -rf /tmp/run-$name-mid
        python3 -m export --checkpoint /tmp/run-$name/checkpoints/last.ckpt --out /tmp/run-$name-mid/export 2>&1 | tail -1
        python3 scripts/device/drafter_parts.py pack /tmp/run-$name-mid/export $OUT/$name-mid-parts --target smollm2-135m-instruct 2>&1 | tail -1
      else
        echo "$name: still training, not brought"
      fi
      continue
    fi
    [ -d /tmp/run-$name/export ] || { echo "$name: no export to bring"; continue; }
    python3 scripts/device/drafter_parts.py pack /tmp/run-$name/export $OUT/$name-parts --target smollm2-135m-instruct 2>&1 | tail -1
  done
  collect
  ;;
bench)
  if [ -f /tmp/mps-on ]; then  # the bench has the GPU to itself, without MPS
    echo quit | nvidia-cuda-mps-control; rm /tmp/mps-on; sleep 2
  fi
  # every trained export side by side with plain, n-gram and suffix (BENCH_K draft lengths), and
  # plain and each drafter BENCH_BATCH prompts at a time; transformers on HF_PROMPTS prompts;
  # EAGLE-3 trees for each DEPTH,TOPK,NODES in BENCH_TREES (empty: none)
  # a training still running (its final walk) is stopped; a run with no export yet is exported
  # from its last checkpoint (a training stopped in its final walk)
  pkill -f "^python3 -m train " && sleep 3
  if [ "${TUNE_ATTENTION:-0}" = 1 ]; then  # time the tree-attention variants first, bench with the best
    python3 scripts/bench_attention.py --out $R ${ATTN_ARGS:-} 2>&1 | tee $R/bench_attention.log | tail -12
    spec=$(grep -a "^best on this GPU" $R/bench_attention.log | sed 's/.*--tree-attention //')
    [ -n "$spec" ] && attention="--tree-attention $spec" && echo "tree attention: $spec"
  fi
  for d in /tmp/run-*; do
    [ -d "$d/export" ] || [ ! -f "$d/checkpoints/last.ckpt" ] || python3 -m export --checkpoint "$d" --out "$d/export" 2>&1 | tail -1
  done
  # BENCH_ONLY=NAME: that export alone; tree-promise copies (run-NAME-tree) are the same weights
  drafters=$(ls -d /tmp/run-${BENCH_ONLY:-*}/export 2> /dev/null | grep -v -- '-tree/export' | tr '\n' ' ')
  # EAGLE-3 trees (graphed, as chains are): a sweep around the best known (6-10-60 over 4-8-40
  # with the recipe's drafter), deeper and wider too
  trees=${BENCH_TREES-4,8,40 5,10,50 6,10,60 6,10,80 7,10,70 8,10,80}
  python3 -m inference.bench --num-prompts 20 --max-new-tokens 256 -k ${BENCH_K:-4 7} ${drafters:+--drafter $drafters} \
    ${attention:-} --batch-size ${BENCH_BATCH:-16} --hf-prompts ${HF_PROMPTS:-2} $(for t in $trees; do echo --tree $t; done) \
    --out $R/bench 2>&1 | grep -v -i "warn\|Loading weights" | tail -45
  cp $R/bench/bench.json $R/bench/bench.png $OUT/ 2> /dev/null
  collect
  ;;
train-ab)  # STEPS NAME=[@DIR]...: training speed of checkouts side by side (scripts/device/train_ab.sh): on carried
  # regenerated answers where a .devN holds them, else on the recipe's own (original ShareGPT answers)
  if ls .dev*/regen-conversations.jsonl.gz > /dev/null 2>&1; then carried_regen; export DATA=$REGEN; fi
  LOGS=$R bash scripts/device/train_ab.sh "$@"
  collect
  ;;
fsdp)  # issue 22 on one GPU: the recipe plain and under FSDP, same steps and data order, side by side
  steps=${1:-40}
  carried_regen
  common=(--config configs/eagle3.yaml trainer.max_steps=$steps checkpoint_every_n_steps=$((steps / 2))
          data.dataset=$REGEN "eval.datasets=[$REGEN]" eval.num_sequences=16 data.num_workers=1 trainer.enable_progress_bar=false)
  python3 -m train "${common[@]}" out_dir=/tmp/fsdp-plain > $R/fsdp-plain.log 2>&1 &
  plain_pid=$!
  python3 -m train "${common[@]}" out_dir=/tmp/fsdp-fsdp trainer.strategy=fsdp > $R/fsdp-fsdp.log 2>&1
  wait $plain_pid  # (a bare wait would wait for the collector too)
  grep -a -h "predicted acceptance\|Error\|error" $R/fsdp-plain.log $R/fsdp-fsdp.log | tail -6
  python3 -m export.check /tmp/fsdp-fsdp/export 2>&1 | tail -1
  python3 scripts/compare_exports.py /tmp/fsdp-plain/export /tmp/fsdp-fsdp/export
  # resumed under FSDP from its last checkpoint, STEPS/2 more, exported again and checked
  python3 -m train "${common[@]}" out_dir=/tmp/fsdp-fsdp trainer.strategy=fsdp trainer.max_steps=$((steps + steps / 2)) \
    --resume /tmp/fsdp-fsdp/checkpoints/last.ckpt > $R/fsdp-resume.log 2>&1
  grep -a -h "predicted acceptance\|Error\|error\|global_step\|Restored" $R/fsdp-resume.log | tail -4
  python3 -c "import torch; c = torch.load('/tmp/fsdp-fsdp/checkpoints/last.ckpt', weights_only=True); print('resumed to step', c['global_step'])"
  python3 -m export.check /tmp/fsdp-fsdp/export 2>&1 | tail -1
  collect
  ;;
promise)  # NAME...: each carried export's promise made again (python -m train.promise) on the carried
  # regenerated answers, for answers served up to 256 tokens, over PROMISE_SEQS held-out conversations
  # (default 256: all 161 of the 7,424 conversations; 64 were too few); in parallel
  # The promise at T = 1 walks answers sampled at T = 1 (eval.sampled_answers): the held-out
  # conversations' answers sampled once here (SAMPLED=0: the greedy answers)
  carried_regen
  sampled=()
  if [ "${SAMPLED:-1}" = 1 ]; then
    python3 -m inference.regenerate --dataset $REGEN --out /tmp/regen-t1 --temperature 1 --heldout-only 0.02 \
      --batch-size 256 > $R/regen-t1.log 2>&1; grep -a "wrote\|error\|already" $R/regen-t1.log | tail -2 || true
    sampled=("eval.sampled_answers={1: /tmp/regen-t1/conversations.jsonl}")
  fi
  for name in "$@"; do
    [ -d /tmp/run-$name/export ] || { echo "$name: no export"; continue; }
    trees=(); [ -n "${TREES:-}" ] && [[ $name == eagle3* ]] && trees=("eval.trees=$TREES")  # EAGLE-3 drafts trees
    python3 -m train.promise /tmp/run-$name/export data.dataset=$REGEN "eval.datasets=[$REGEN]" eval.max_new_tokens=256 \
      eval.num_sequences=${PROMISE_SEQS:-256} "${sampled[@]}" "${trees[@]}" --no-progress \
      > $R/promise-$name.log 2>&1 &
    pids+=($!)
  done
  [ ${#pids[@]} -gt 0 ] && { wait "${pids[@]}" || true; }  # one failed promise still leaves the others' logs to print and collect
  for name in "$@"; do echo "== $name"; grep -a -v -i "warn" $R/promise-$name.log | tail -5; cp /tmp/run-$name/export/draftsmith.json $R/$name-draftsmith.json 2>/dev/null; done
  collect
  ;;
tree-promise)  # NAME...: a copy of each `fresh` export (/tmp/run-NAME-tree) promising draft trees alone
  # (TREES, default [[4,4,24]]) on ShareGPT's held-out answers at T = 0: the export's own promise
  # stays whole, and the tree walk runs apart from the trainings' final walks.
  # Then: serve NAME-tree@tree-4-4-24
  for name in "$@"; do
    [ -d /tmp/run-$name/export ] || { echo "$name: no export"; continue; }
    rm -rf /tmp/run-$name-tree && mkdir -p /tmp/run-$name-tree && cp -r /tmp/run-$name/export /tmp/run-$name-tree/
    python3 -m train.promise /tmp/run-$name-tree/export "eval.trees=${TREES:-[[4,4,24]]}" "eval.datasets=[$HELD_T0]" \
      eval.temperatures=[0] "eval.sampled_answers={}" eval.num_sequences=${PROMISE_SEQS:-256} --no-progress \
      > $R/tree-promise-$name.log 2>&1 &
    pids+=($!)
  done
  [ ${#pids[@]} -gt 0 ] && { wait "${pids[@]}" || true; }  # (a bare wait would wait for the collector: forever)
  for name in "$@"; do echo "== $name"; grep -a -v -i "warn" $R/tree-promise-$name.log 2> /dev/null | tail -4; done
  collect
  ;;
profile-tree)  # a tree step's cost against a chain's before any drafter is trained (issue 20)
  python3 -m pytest -q -p no:cacheprovider tests/test_tree_select.py tests/test_tree_accept.py tests/test_tree_attention.py \
    tests/test_lm_head_topk.py 2>&1 | tail -2 | tee $R/tree-kernels.log
  python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_tree_decoding.py > /tmp/tree-gpu.log 2>&1
  grep -a "PASSED\|FAILED\|ERROR\|passed\|failed" /tmp/tree-gpu.log | tail -4 | tee -a $R/tree-kernels.log
  tail -c 100000 /tmp/tree-gpu.log > $R/tree-gpu.log
  # the tree-attention kernel's tuning variants, timed alone (kernels/tree_attention.py MAX_BLOCK_Q, PRODUCTS_16BIT)
  python3 scripts/bench_attention.py --out $R 2>&1 | tee $R/bench_attention.log | tail -8
  trees=${PROFILE_TREES:-4,4,24 6,8,48}
  first=${trees%% *}
  python3 scripts/profile_spec.py --rows "EAGLE-3" $(for t in $trees; do echo --tree $t; done) --trace \
    --trace-rows "EAGLE-3 k=4,EAGLE-3 tree ${first//,/-}" --out /tmp/profile 2>&1 | tee $R/profile.log | grep -v -i "warn\|Loading weights" \
    | grep -v "^ *\(aten\|cuda\|void\|Memcpy\|Memset\|triton\|ampere\|sm90\|nvjet\|cutlass\)" | head -40
  for f in /tmp/profile/trace-*.json.gz; do  # (the traces stay there: too large to come back)
    echo "== $f"; python3 scripts/trace_kernels.py $f --range draftsmith.loop_run --top 32 | tee $R/$(basename $f .json.gz).txt
  done
  collect
  ;;
bring)  # NAME...: each export's parts (at most 8 files and 64 MiB come back per call)
  kill $collector 2> /dev/null  # no results.tgz: a file fewer
  for name in "$@"; do
    python3 scripts/device/drafter_parts.py pack /tmp/run-$name/export $OUT/$name-parts --target smollm2-135m-instruct
  done
  ;;
unpack)  # every carried .devN/NAME-parts, gathered under /tmp/parts; an export unpacked once all its parts are there
  # the carried folders do not stay on the machine between calls (a drafter staged over .dev4 and
  # .dev5 would never meet its other half); /tmp does, so each call copies its parts there
  for d in .dev*/*-parts; do
    [ -d "$d" ] || continue
    mkdir -p /tmp/parts/$(basename $d) && cp $d/* /tmp/parts/$(basename $d)/
  done
  for d in /tmp/parts/*-parts; do
    [ -d "$d" ] || continue
    name=$(basename $d); name=${name%-parts}
    # a run of this name trained in this lease (or unpacked already) keeps its own export
    [ -d /tmp/run-$name ] && { echo "$name: /tmp/run-$name exists, its carried parts left packed"; continue; }
    # a missing part stops unpack before it writes anything: carry the rest in a later call
    python3 scripts/device/drafter_parts.py unpack $d /tmp/run-$name/export --target smollm2-135m-instruct 2>&1 | tail -4
  done
  ;;
final | validate)
  # final: the last call of a session: stop what is still training, bench alone, then validate
  # in the time left (VAL_MINUTES each). validate: only the validations.
  if [ "$what" = final ]; then
    t0=$SECONDS
    while pgrep -f "^python3 -m train " > /dev/null && [ $((SECONDS - t0)) -lt 45 ]; do sleep 5; done
    pkill -f "^python3 -m train "; sleep 3
    collect
    python3 -m inference.bench --num-prompts 20 --max-new-tokens 256 -k 4 --out $R/bench 2>&1 | grep -v -i "warn\|Loading weights" | tail -14
    collect
  fi
  # ALONGSIDE: RUNS-style specs trained ALONGSIDE_MINUTES while the validations run (the GPUs
  # have room then; e.g. the joint recipes for their peak memory and perplexity)
  [ -n "${ALONGSIDE:-}" ] && start_runs "$ALONGSIDE" "${ALONGSIDE_MINUTES:-3}"
  # T = 0 for each trained export on mt-bench (both turns), T = 1 standard and block for EAGLE-3,
  # DFlash and MTP, HumanEval at T = 0 for the three; all in parallel (each is bound by its host loop, not by the GPU)
  # EAGLE-3 at T = 0 with the reference rows: VAL_REF_PROMPTS questions (6 per category), so
  # that the n-gram and suffix rows, served after it on the same questions, fit the call too
  # (EAGLE-3 on the original answers on those very questions: regenerated against original)
  bg eagle3 --reference ngram --reference suffix --num-prompts ${VAL_REF_PROMPTS:-48}
  bg eagle3-orig --num-prompts ${VAL_REF_PROMPTS:-48}
  for n in dflash medusa1 mtp eagle1 mtp-joint medusa2; do bg $n; done
  bg eagle3@t1-standard --temperature 1 --verification standard
  bg eagle3@t1-block --temperature 1 --verification block
  bg dflash@t1-standard --temperature 1 --verification standard
  bg dflash@t1-block --temperature 1 --verification block
  bg mtp@t1-standard --temperature 1 --verification standard
  bg mtp@t1-block --temperature 1 --verification block
  # code answers (issue 21's second set), greedy, all 164 HumanEval problems where the time allows
  for n in eagle3 dflash mtp; do bg $n@humaneval --dataset humaneval --num-prompts 164 $(he_promise $n); done
  wait "${pids[@]}"  # the validations and any ALONGSIDE runs
  [ -n "${ALONGSIDE:-}" ] && train_summary
  val_summary
  collect
  ;;
serve)  # SPEC...: NAME[@t1-standard | @t1-block | @humaneval] each served in parallel on all VAL_PROMPTS (80)
  # MT-bench questions (or all 164 HumanEval problems) against its promise (issue 21)
  for spec in "$@"; do
    case $spec in
      *@t1-standard) bg $spec --temperature 1 --verification standard ;;
      *@t1-block) bg $spec --temperature 1 --verification block ;;
      # HumanEval against the promise on its held-out half where the export made one (`fresh`),
      # serving the other half
      *@humaneval) bg $spec --dataset humaneval --num-prompts 164 $(he_promise ${spec%%@*}) ;;
      *@tree-*) t=${spec#*@tree-}; bg $spec --tree ${t//-/,} ;;  # NAME@tree-D-K-N: against the tree promise (TREES)
      *) bg $spec ;;
    esac
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
  val_summary
  collect
  ;;
esac
