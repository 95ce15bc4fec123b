"""A speculative step's launches, counted on the CPU (scripts/count_launches.py), stay within
what the device loop needs today: on a small target a step's GPU time follows its number of
kernels, so a change that adds launches to a phase shows here before any GPU lease."""
import json
import os
import subprocess
import sys
from pathlib import Path

# launches per phase on the tiny target at k = 3; lower is welcome
CEILINGS = {
    "eagle3": {"verify_phase": 27, "proposer_phase": 37},
    "mtp": {"verify_phase": 27, "proposer_phase": 133},
    "dflash": {"verify_phase": 27, "proposer_phase": 41},
    "medusa": {"verify_phase": 27, "proposer_phase": 22},
    "ngram-gpu": {"verify_phase": 27, "proposer_phase": 15},
    # an EAGLE-2 tree (depth 4, top-k 4, 24 nodes): on a small target a launch costs 3-4 µs of an
    # H200's step, so the tree's drafting and verify follow these counts (the step's launches in
    # order, and which launch carries which fused epilogue: docs/trees.md)
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
