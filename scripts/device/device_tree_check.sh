#!/usr/bin/env bash
# Issue 20's whole measurement in one device call (draft trees against chains on the H200), on a
# machine where `bash scripts/device/device_session.sh part1` (carry .whl .dev1) has just run: carry .whl
# and .dev7 (the benched EAGLE-3 export's parts and the target's second half), and .ab (`mkdir -p .ab/old
# && git archive COMMIT | tar -x -C .ab/old`, without its tests, docs, train/, data/, export/ and
# configs/, which the profile does not import: 64 MiB in all with the tree) for the side-by-side step
# times; every other checkout in .ab (.ab/NAME) is timed too, after old and this one. About 500 s:
#   bash scripts/device/device_tree_check.sh     # TREES="6,10,60,4 ..." (the bench's trees), AB_TREE (the A/B's), AB_EXTRA,
#                                         # KERNEL_TESTS (the CUDA test files of step 1), KNOBS=0 (no step 2)
# 1. the tree kernels' tests on CUDA, then the graphed tree and chain loops against their eager runs
#    (-m gpu); a failure stops the call there (no bench of broken kernels);
# 2. the selection's launch settings timed alone (scripts/bench_tree_select.py: warps, rerank tiles);
# 3. with .ab/old carried: a tree step's device time on random weights of the real shapes, the older
#    checkout against this one (scripts/device/ab_profile.sh: ms a step, draft / verify);
# 4. the bench: plain, the EAGLE-3 chains at k = 4 and 6, the trees, one process (inference/bench.py),
#    REPEATS passes (default 3) over its runtime rows, each row's median pass kept.
# Writes $OUT/tree-check.log, $OUT/bench_tree_select.json, $OUT/ab/NAME/profile_spec.json and $OUT/bench.json.
set -uo pipefail
bash scripts/device/device_session.sh unpack
source scripts/device/device_setup.sh
set +e
log=$OUT/tree-check.log
date -u +'start %H:%M:%S' | tee $log
python3 -m pytest -q -p no:cacheprovider ${KERNEL_TESTS:-tests/test_tree_select.py tests/test_tree_accept.py \
  tests/test_tree_attention.py tests/test_lm_head_topk.py} > /tmp/tree-kernels.log 2>&1
kernels=$?
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tree_decoding.py tests/test_spec_loop.py > /tmp/tree-gpu.log 2>&1
loops=$?
tail -n 3 /tmp/tree-kernels.log /tmp/tree-gpu.log | tee -a $log
if [ $kernels != 0 ] || [ $loops != 0 ]; then
  grep -a "FAILED\|Error" /tmp/tree-kernels.log /tmp/tree-gpu.log | head -20 | tee -a $log
  echo "tests failed: no A/B, no bench" | tee -a $log
  exit 1
fi
if [ "${KNOBS:-1}" != 0 ]; then
  date -u +'selection knobs %H:%M:%S' | tee -a $log
  python3 scripts/bench_tree_select.py --out $OUT 2>&1 | grep -a -v -i warn | tail -16 | tee -a $log
fi
if [ -d .ab/old ]; then
  date -u +'A/B %H:%M:%S' | tee -a $log
  # AB_EXTRA: more variants, one NAME=FLAGS a line (profile_spec.py's kernel settings; ~45 s each; with the .ab
  # checkouts at most two beside old and new: a call brings back 8 files), e.g.
  # AB_EXTRA='q32=--tree-attention max_block_q=32'
  extra=()
  for dir in .ab/*/; do
    name=$(basename "$dir")
    [ "$name" != old ] && extra+=("$name=@$dir")
  done
  [ -n "${AB_EXTRA:-}" ] && mapfile -t -O ${#extra[@]} extra <<< "$AB_EXTRA"
  AB_TREE=${AB_TREE:-6,10,60,4} OUT=$OUT/ab bash scripts/device/ab_profile.sh old=@.ab/old new= "${extra[@]}" 2>&1 | tee -a $log
fi
date -u +'bench %H:%M:%S' | tee -a $log
python3 -m inference.bench --num-prompts 20 --max-new-tokens 256 -k 4 6 --drafter /tmp/run-eagle3/export --batch-size 1 \
  --hf-prompts 1 $(for t in ${TREES:-6,10,60,4}; do echo --tree $t; done) --repeats ${REPEATS:-3} --out /tmp/bench-check 2>&1 \
  | grep -a -v -i "warn\|Loading weights" | tail -60 | tee -a $log
cp /tmp/bench-check/bench.json $OUT/ 2> /dev/null
date -u +'end %H:%M:%S' | tee -a $log
