#!/usr/bin/env bash
# Variants side by side in one device call: scripts/profile_spec.py (random weights of the real
# shapes: plain, the EAGLE-3 chain at k = 4 and one tree) once per variant, in the order given.
# A variant is NAME=PYTHON (statements run before the profile: knobs set on the kernels' modules)
# or NAME=@DIR (the profile run from DIR, an older checkout carried beside this one:
# `mkdir -p .ab/old && git archive COMMIT | tar -x -C .ab/old`; carry .ab, which git ignores).
# Repeat the first variant last to see the drift within the call. On the device machine, after
# `source scripts/device_setup.sh`:
#   AB_TREE=4,8,40,4 bash scripts/ab_profile.sh old=@.ab/old "new=" \
#     "q32=import draftsmith_kernels.tree_attention as a; a.MAX_BLOCK_Q = 32" old2=@.ab/old
# Each variant's profile_spec.json lands in $OUT/NAME.
set -u
export DRAFTSMITH_TREES_GRAPHED=1
tree=${AB_TREE:-4,8,40,4}
here=$(pwd)
for spec in "$@"; do
  name=${spec%%=*}
  body=${spec#*=}
  dir=.
  case $body in @*) dir=${body#@}; body="" ;; esac
  echo "== $name"
  (cd "$dir" && PYTHONPATH=. python3 -c "$body
import scripts.profile_spec as p
p.main(['--rows', 'EAGLE-3 k=4,EAGLE-3 tree', '--tree', '$tree', '--out', '${OUT:-$here/ab}/$name'])" 2>&1 \
    | grep -a "^row\|^plain\|^EAGLE\|Error" | tail -4)
done
