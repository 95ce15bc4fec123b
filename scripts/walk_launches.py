"""aten ops launched by each held-out walk over one long conversation (tiny target, CPU): the
GPU cost proxy of the walk, which is launch-bound on a small model.

    PYTHONPATH=. python scripts/walk_launches.py [--tree]

The text is random tokens in four answer spans of 256 tokens (the serving budget), walked by
the greedy chain walk and by the sampled walk at T = 1 (standard verification) in windows of
128 anchors and in its default windows (inference/walks/sampled.py `sampled_window`).
--tree adds the EAGLE-2 tree walk (depth 4, top-k 4, 24 nodes). On random text every tree is
grafted onto the text again, one target forward per round, which takes minutes on a CPU and is
not what the target's own answers cost.
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="store_true", help="also the tree walk (slow on random text)")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from inference.walks.greedy import cap_answer_spans, predicted_histogram
    from inference.walks.sampled import sampled_histogram
    from inference.walks.tree import predicted_tree_histograms
    from models.target import Target
    from models.zoo import resolve_target
    from scripts.count_launches import LaunchCounter
    from tests.test_spec_loop import _random_drafters

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-random-llama"), dtype=torch.float32).eval()
    drafter = _random_drafters(hf)["eagle3"]
    target = Target.load("tiny-random-llama", drafter.aux_layer_ids)
    T, k = 1200, 7
    ids = torch.randint(10, 1000, (1, T))
    mask = torch.zeros(1, T, dtype=torch.long)
    for s in range(4):  # four answers of 256 tokens, each after a 40-token prompt
        mask[0, 40 + s * 296 : 40 + s * 296 + 256] = 1
    lengths = torch.tensor([T])
    mask = cap_answer_spans(mask, 256)
    with torch.no_grad():
        out = target(ids)
        feats = drafter.features(out)
        _, greedy = target.head_outputs(out.last_hidden)

    def sampled(window):
        return lambda: sampled_histogram(target, drafter, ids, mask, lengths, k, None, 1.0, "standard",
                                         torch.Generator().manual_seed(0), features=feats, last_hidden=out.last_hidden,
                                         window=window)

    walks = {"greedy": lambda: predicted_histogram(target, drafter, ids, mask, lengths, k, None, features=feats, greedy=greedy),
             "sampled, windows of 128": sampled(128), "sampled, default windows": sampled(None)}
    if args.tree:
        walks["tree 4,4,24"] = lambda: predicted_tree_histograms(target, drafter, ids, mask, lengths, [(4, 4, 24)], None,
                                                                 features=feats, greedy=greedy)
    for name, walk in walks.items():
        with torch.no_grad(), LaunchCounter() as counted:
            t0 = time.time()
            walk()
            seconds = time.time() - t0
        print(f"{name:26s} {sum(counted.ops.values()):7d} aten ops  {seconds:6.2f} s  most frequent: "
              + ", ".join(f"{op} {n}" for op, n in counted.ops.most_common(4)))


if __name__ == "__main__":
    main()
