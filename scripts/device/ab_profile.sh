#!/usr/bin/env bash
# Variants side by side in one device call: scripts/profile_spec.py (random weights of the real
# shapes: plain, the EAGLE-3 chain at k = 4 and one tree) once per variant, in the order given.
# A variant is NAME=FLAGS (more flags for profile_spec.py: the kernel settings, e.g.
# `--tree-attention max_block_q=32` or `--kernels off`) or NAME=@DIR (the profile run from DIR, an
# older checkout carried beside this one: `mkdir -p .ab/old && git archive COMMIT | tar -x -C .ab/old`;
# carry .ab, which git ignores). Repeat the first variant last to see the drift within the call.
# On the device machine, after `source scripts/device/device_setup.sh`:
#   AB_TREE=4,8,40,4 bash scripts/device/ab_profile.sh old=@.ab/old "new=" "q32=--tree-attention max_block_q=32" old2=@.ab/old
# Each variant's profile_spec.json lands in $OUT/NAME.
set -u
tree=${AB_TREE:-4,8,40,4}
here=$(pwd)
for spec in "$@"; do
  name=${spec%%=*}
  flags=${spec#*=}
  dir=. old=()
  # an older checkout: those from before the graphed tree step became the default graph it only
  # with this variable (this checkout reads no variable)
  case $flags in @*) dir=${flags#@}; flags=""; old=(env DRAFTSMITH_TREES_GRAPHED=1) ;; esac
  echo "== $name"
  # (flags word-split on purpose: NAME=--flag value)
  (cd "$dir" && PYTHONPATH=.:${PYTHONPATH:-} "${old[@]}" python3 scripts/profile_spec.py --rows 'EAGLE-3 k=4,EAGLE-3 tree' \
    --tree "$tree" --out "${OUT:-$here/ab}/$name" $flags 2>&1 | grep -a "^row\|^plain\|^EAGLE\|Error" | tail -4)
done
