"""Predicted tau of chains and draft trees for one EAGLE-3 export, on the target's own greedy
answers to the bench's questions: which tree shapes are worth a GPU bench, chosen on a CPU.

    PYTHONPATH=. python scripts/sweep_trees.py EXPORT --chains 4,5 --tree 4,8,40,4 --tree 5,10,50

The answers are served once in float32 (greedy, through the runtime with the drafter itself: lossless,
so they are the target's plain greedy answers) to the first N questions of the data set, first turn
only, as `inference.bench` serves them; each shape is then walked over them by the predictor that
training's promise and `inference.validate` use (inference/served.py `replay`). On the GPU the
bench runs in bf16, whose texts and taus differ a little (on an H200 the runtime's tree taus ran
about 5-7 % above these). The walks are slow on a CPU: a 4-8-40-4 tree over 20 answers of 256
tokens takes about 1.5 minutes on two cores, a 6-10-60 tree about 3.5.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", help="an EAGLE-3 (or EAGLE-1) export folder")
    ap.add_argument("--chains", default="4", help="chain lengths, comma-separated (empty: none)")
    ap.add_argument("--tree", action="append", default=[], metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="a tree shape as inference.bench takes it; repeat for a sweep")
    ap.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval or a JSON/JSONL file of prompts")
    ap.add_argument("--num-prompts", type=int, default=20, help="first N questions (default 20, the bench's)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--answers", default=None, help="a JSON file of the served answers: read when it was written for "
                    "this target and these questions, else served and written there (serving takes minutes on a CPU)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    import torch

    from inference.cli import CliError, parse_tree_spec

    try:
        try:
            chains = sorted({int(k) for k in args.chains.split(",") if k.strip()})
        except ValueError:
            raise CliError(f"--chains {args.chains}: expected comma-separated integers, e.g. 4,5,6") from None
        if any(k < 1 for k in chains):
            raise CliError(f"--chains {args.chains}: lengths must be positive")
        trees = [parse_tree_spec(spec) for spec in args.tree]
        if not chains and not trees:
            raise CliError("nothing to walk: give --chains or --tree")
        if args.num_prompts < 1 or args.max_new_tokens < 1:
            raise CliError("--num-prompts and --max-new-tokens must be positive")
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    provenance_path = Path(args.export) / "draftsmith.json"
    if not provenance_path.is_file():
        print(f"error: {args.export}: no draftsmith.json (an export made by `python -m train`)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from data.sources import DataError
    from models.zoo import AssetError

    try:
        return sweep(args, chains, trees, provenance_path)
    except (ValueError, KeyError, OSError, DataError, AssetError) as e:  # a data set, target or export that will not load
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2


def sweep(args, chains: list[int], trees: list[tuple[int, ...]], provenance_path: Path) -> int:
    """Serve (or read) the answers, walk each shape over them, print and write the rows."""
    import torch
    from transformers import AutoTokenizer

    from data.sources import load_prompts
    from data.templates import apply_template_choice
    from export.io import atomic_write_json, read_json
    from export.load import load_export
    from inference.walks.greedy import acceptance_from_histogram
    from inference.runtime.fallback import load_runtime
    from inference.served import measure, replay
    from models.target import Target
    from models.zoo import resolve_target
    from train.config import config_from_dict

    cfg = config_from_dict(read_json(provenance_path)["training_config"], [])
    path = resolve_target(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)
    drafter = load_export(args.export).eval()
    if trees and cfg.drafter.method not in ("eagle3", "eagle1"):
        print(f"error: {args.export}: a {cfg.drafter.method} export; trees are drafted by EAGLE-3 and EAGLE-1 drafters",
              file=sys.stderr)
        return 2
    served_for = {"target": cfg.target, "dataset": args.dataset, "num_prompts": args.num_prompts,
                  "max_new_tokens": args.max_new_tokens}
    kept = None
    if args.answers and Path(args.answers).exists():
        try:
            kept = read_json(args.answers)
        except (ValueError, OSError):
            kept = None
        if not (isinstance(kept, dict) and {"served_for", "served", "records"} <= set(kept)):
            print(f"error: --answers {args.answers}: not answers this script wrote; left as it is", file=sys.stderr)
            return 2
    this_export = str(Path(args.export).resolve())
    if kept and kept["served_for"] == served_for:
        records, served = kept["records"], kept["served"]
        print(f"{len(records)} answers read from {args.answers}")
    else:
        questions = load_prompts(args.dataset)[: args.num_prompts]
        t0 = time.time()
        served_k = max(chains or [4])
        with torch.no_grad():
            records = measure(load_runtime(path), tokenizer, drafter, questions, served_k, args.max_new_tokens, 0.0,
                              max_turns=1)
        histogram = sum(torch.as_tensor(r["histogram"]) for r in records)
        served = {"export": this_export, "k": served_k, "tau": acceptance_from_histogram(histogram)["tau"], "histogram": histogram.tolist()}
        records = [{"prompt": r["prompt"], "answer": r["answer"]} for r in records]
        print(f"served {len(records)} answers, {sum(len(r['answer']) for r in records)} tokens, in {time.time() - t0:.0f} s")
        if args.answers:
            atomic_write_json(args.answers, {"served_for": served_for, "served": served, "records": records})
    if served["export"] == this_export:  # kept answers serve any drafter of the target; the chains were this one's
        print(f"the runtime's chains at k={served['k']} accepted tau {served['tau']:.3f} (in float32 the walk's "
              f"k={served['k']} row drafts the same chains)")
    else:
        served = None
    target = Target.load(cfg.target, list(getattr(drafter, "aux_layer_ids", [])))
    shapes = [(f"chain k={k}", k, None) for k in chains] + [("tree " + "-".join(map(str, t)), t[0], t) for t in trees]
    rows = []
    for name, k, tree in shapes:
        t0 = time.time()
        with torch.no_grad():
            hist = replay(target, drafter, records, k, None, "answer", tree=tree)
        acceptance = acceptance_from_histogram(hist)  # tau: 1 + the mean drafts accepted a step
        rows.append({"shape": name, "tau": acceptance["tau"], "steps": acceptance["num_chains"], "histogram": hist.tolist()})
        print(f"{name:24s} predicted tau {acceptance['tau']:.3f}  ({acceptance['num_chains']} steps, "
              f"{time.time() - t0:.0f} s)", flush=True)
    best = max(rows, key=lambda r: r["tau"])
    print(f"highest predicted tau: {best['shape']} ({best['tau']:.3f}); a GPU bench weighs it against its step's cost")
    if args.json:
        atomic_write_json(args.json, {"served": served, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
