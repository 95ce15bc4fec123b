"""A speculative step's launches, counted on the CPU (scripts/count_launches.py), stay within
what the device loop needs today: on a small target a step's GPU time follows its number of
kernels, so a change that adds launches to a phase shows here before any GPU lease."""
import json
import os
import subprocess
import sys
from pathlib import Path

# launches per phase on the tiny target at k = 3 (session 13's counts; session 21: one fewer in
# each proposer phase, the rows still running kept by the emit kernel instead of a `~done`);
# lower is welcome
CEILINGS = {
    "eagle3": {"verify_phase": 27, "proposer_phase": 37},
    "mtp": {"verify_phase": 27, "proposer_phase": 133},
    "dflash": {"verify_phase": 27, "proposer_phase": 41},
    "medusa": {"verify_phase": 27, "proposer_phase": 22},
    "ngram-gpu": {"verify_phase": 27, "proposer_phase": 15},
    # an EAGLE-2 tree (depth 4, top-k 4, 24 nodes): session 13 measured 1.0 ms of drafting per
    # step on an H200 against a chain's 0.17, about what these counts cost at 3-4 µs a launch;
    # session 14 kept the ancestor matrix level by level and sent the rotary and candidate writes
    # through kernels/rope_cache (114 / 291 before; 98 / 263 measured 0.87 ms of drafting);
    # session 15 gave the frontier its depth as a number and extended the ancestor matrix of
    # candidates alone past the root's children (218 before); session 16 took the verified
    # tree's bookkeeping into one kernel (kernels/tree_accept.py: verify 98 before) and EAGLE-2's
    # selection into one per depth and one for the rerank (kernels/tree_select.py: 183 before);
    # session 17 the tree's head into two (kernels/lm_head_topk.py: 80 before) and the rerank's
    # ranks into a launch of their own (parallel over candidates: 72 before), then the verify
    # step's input through the chain's feed kernel and one Tree that every draft writes in place
    # (no copies: 41 / 73 before); session 18 each level's parents read from the drafter's last
    # output (no buffer of every candidate's hidden state to fill) and the candidates' K and V in
    # one buffer zeroed once (68 before), and the accepted path's cache moves in one launch
    # (kernels/tree_accept.py: verify 37 before); session 19 each level's gather of its parents
    # into the input norms' launch (kernels/rms_norm.py rms_norm_pair x_rows: 63 before); session
    # 20 one launch more, on purpose: the verify's argmax in parallel chunks and a merge
    # (kernels/argmax.py) instead of torch's one program a row (13 µs at 41 rows on an H200; with
    # 128-key attention tiles the verify step measured 14-16 µs faster); session 21 the verify's
    # slots and mask without launches of their own (RoPE's tree_block, the tree kernel reading
    # node t-1's row for query t: 35 before), then the rows still running from the emit kernel
    # (31 / 60 before), no clearing of the candidates' K/V where the tree kernel runs (it reads
    # only slots some query sees) and the nodes' positions offset inside the rerank (58 before);
    # session 23 the verify's argmax merge and emission inside the tree's bookkeeping kernel, and
    # the path's features gathered by the drafter's input norm (30 before), the tree now drafted
    # with the recipe's input norm before fc (configs/eagle3.yaml; its own launch: 57 without)
    # session 30 each depth's expansion inside the head's merge and the next layer's input norms
    # (kernels/tree_select.py: 58 before); session 33 the rerank's ranks and nodes in one launch,
    # which also writes the verify step's input (54 / 27 before); session 34 the drafter's next
    # tokens and positions made by the tree's bookkeeping kernel (53 before), and the verify's
    # cache moves by the rerank's launch (26 before)
    "eagle3-tree": {"verify_phase": 25, "proposer_phase": 52},
}


def test_no_phase_launches_more_than_it_did():
    root = Path(__file__).resolve().parents[1]
    # the proposers held to a ceiling alone (each costs seconds of Triton's CPU interpreter)
    res = subprocess.run([sys.executable, "scripts/count_launches.py", "--json", "--proposers", ",".join(CEILINGS)], cwd=root,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    over = [f"{name} {phase}: {counts[name][phase]} launches (at most {ceiling})"
            for name, phases in CEILINGS.items() for phase, ceiling in phases.items() if counts[name][phase] > ceiling]
    assert not over, "\n".join(over)
    assert counts["eagle3"]["proposer_phase"] > 20  # the count sees the drafter's work at all
