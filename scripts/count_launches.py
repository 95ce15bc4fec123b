"""Launches per phase of a speculative step, counted on a CPU: the proxy of a step's cost on a
GPU, where a small model's step is bound by its number of kernels (2-4 µs each), not by FLOPs.

    python scripts/count_launches.py [--k 3] [--only eagle3-tree]   # --only: one proposer, every op listed
    python scripts/count_launches.py --json --proposers eagle3,mtp  # these proposers alone

Runs the device loop on the tiny random target (float32, `TRITON_INTERPRET=1` and the kernels'
mode "force", so every runtime kernel runs as on a GPU) with random drafters of
each family and an EAGLE-2 tree (depth 4, top-k 4, 24 nodes), and counts, in one verify phase and one proposer phase (advance, then draft),
the aten ops that launch work and the Triton kernel launches.
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # (before triton is first imported)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that only describe memory (views, metadata) launch nothing
NO_LAUNCH = {"view", "_unsafe_view", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "as_strided",
             "reshape", "detach", "alias", "permute", "split_with_sizes", "split", "unbind", "narrow", "empty", "lift_fresh",
             "_to_copy", "empty_like", "new_empty", "promote_types", "empty_strided", "result_type"}


class LaunchCounter(TorchDispatchMode):
    """aten ops run under it, except views and those inside an interpreted Triton kernel."""

    inside_triton = 0

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not LaunchCounter.inside_triton:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_triton_launches():
    """Patch the interpreter so that each kernel launch is counted (and its own torch work is not)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches["triton"] += 1
        LaunchCounter.inside_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            LaunchCounter.inside_triton -= 1

    InterpretedFunction.run = counted
    return launches


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print {proposer: {phase: launches}} as JSON instead")
    ap.add_argument("--only", help="this proposer alone (eagle3, eagle3-tree, ...), every aten op of its phases listed")
    ap.add_argument("--proposers", help="these proposers alone, comma-separated (default: all of them)")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import inference.runtime.spec_loop as spec_loop
    from draftsmith_kernels.settings import KernelSettings
    from inference.runtime.engine import cache_size, generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import GpuNgramProposer, drafter_proposer
    from inference.tree.loop import EagleTreeProposer
    from models.zoo import resolve_target
    from tests.test_spec_loop import _random_drafters

    launches = count_triton_launches()
    folder = resolve_target("tiny-random-llama")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(folder)
    rt.kernels = KernelSettings(mode="force")  # every generation below runs the kernels (interpreted)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6]]
    max_len = cache_size(prompts, 16, args.k)
    rows = {}

    def counting_run(self, max_steps, check_every):  # one verify and one proposer phase, counted; no more steps
        self.draft_phase()
        for phase in ("verify_phase", "proposer_phase"):
            launches.clear()
            with LaunchCounter() as ops:
                getattr(self, phase)()
            rows[(name, phase)] = (sum(ops.ops.values()), launches["triton"], ops.ops.most_common(None if args.only else 5))
        return {"draft": 0.0, "verify": 0.0, "launch": 0.0, "launched": 1, "syncs": 1}

    spec_loop.SpecLoop.run = counting_run
    proposers = {n: (lambda d=d: drafter_proposer(d, args.k, 1, max_len, rt.config)) for n, d in _random_drafters(hf).items()}
    proposers["ngram-gpu"] = lambda: GpuNgramProposer(args.k, 1, max_len)
    # an EAGLE-2 tree of the bench's smallest setting (depth 4, top-k 4, 24 nodes): its cache holds 25 verify slots
    tree_len = cache_size(prompts, 16, 24)
    eagle = _random_drafters(hf)["eagle3-norms"]  # the recipe's input norm before fc (configs/eagle3.yaml)
    proposers["eagle3-tree"] = lambda: EagleTreeProposer(eagle, depth=4, top_k=4, total_tokens=24, batch=1,
                                                         max_len=tree_len, target_config=rt.config)
    lengths = {"eagle3-tree": tree_len}
    if args.only and args.only not in proposers:
        ap.error(f"--only {args.only}: not one of {', '.join(proposers)}")
    chosen = args.proposers.split(",") if args.proposers else list(proposers)
    if set(chosen) - set(proposers):
        ap.error(f"--proposers {args.proposers}: not all of them in {', '.join(proposers)}")
    for name, make in proposers.items():
        if (args.only and name != args.only) or name not in chosen:
            continue
        generate(rt, prompts, 8, proposer=make(), max_len=lengths.get(name, max_len))
    if args.json:
        import json

        counts: dict = {}
        for (name, phase), (aten, triton_launches, _) in rows.items():
            counts.setdefault(name, {})[phase] = aten + triton_launches
        print(json.dumps(counts))
        return
    print(f"{'proposer':14s} {'phase':15s} {'launches':>8s} {'aten':>5s} {'triton':>6s}  most frequent aten ops")
    for (name, phase), (aten, triton_launches, top) in rows.items():
        print(f"{name:14s} {phase:15s} {aten + triton_launches:8d} {aten:5d} {triton_launches:6d}  "
              + ", ".join(f"{op} {n}" for op, n in top))


if __name__ == "__main__":
    main()
