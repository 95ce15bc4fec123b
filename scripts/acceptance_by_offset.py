"""Where along its answers a drafter's acceptance climbs, on the held-out set its promise walks
and on the answers the runtime serves: chains bucketed by the answer token they start at.

    python scripts/acceptance_by_offset.py EXPORT [--dataset mt-bench] [--num-prompts N]
        [--max-new-tokens 256] [--heldout-sequences 256] [--device cpu|cuda] [--out FILE.json]

The held-out side is the export's own (its training config, as `python -m train.promise` reads
it), walked over whole answers; the served side is --dataset served greedily through the runtime
with the drafter (both turns of MT-bench), walked the same way (inference/walks/greedy.py: on
served greedy answers that walk is the runtime's own). Prints tau per turn and per offset bucket
for both, and the held-out tau counting only chains before --max-new-tokens: what
`eval.max_new_tokens` promises: acceptance climbs along an answer, so a promise over whole
answers over-promises serving capped at a budget.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BUCKETS = (0, 32, 64, 128, 256, 512)


def bucket(offset: int) -> str:
    """'lo-hi' for the bucket holding an answer offset (the last one is open-ended)."""
    lo = max(b for b in BUCKETS if b <= offset)
    hi = next((b for b in BUCKETS if b > offset), None)
    return f"{lo}-{hi - 1}" if hi else f"{lo}+"


def bucket_start(name: str) -> int:
    """The first offset of a bucket named by `bucket`."""
    return int(name.split("-")[0].rstrip("+"))


def span_starts(mask: list[int]) -> list[int | None]:
    """For each position of an answer mask, where its answer span began (None outside spans)."""
    out, start = [], None
    for i, m in enumerate(mask):
        start = (i if (i == 0 or not mask[i - 1]) else start) if m else None
        out.append(start)
    return out


def walk(target, drafter, rows, k: int, device: str):
    """rows: (ids, mask, turn or None) → {(turn '1' | '2+', bucket): [chains, accepted]}."""
    import torch

    from inference.walks.greedy import predicted_histogram

    stats = defaultdict(lambda: [0, 0])
    for ids, mask, turn in rows:
        starts = span_starts(mask)

        def on_chain(_, anchor, later, accepted):
            later = later if turn is None else turn > 1
            cell = stats["2+" if later else "1", bucket(anchor + 1 - starts[anchor + 1])]
            cell[0] += 1
            cell[1] += accepted

        t = torch.as_tensor([ids], device=device)
        predicted_histogram(target, drafter, t, torch.as_tensor([mask], device=device), torch.as_tensor([len(ids)]), k,
                            None, on_chain=on_chain)
    return stats


def table(stats: dict, cap: int) -> dict:
    """Per turn: tau per bucket, overall, and counting only chains starting before `cap`."""
    out = {}
    for turn in ("1", "2+"):
        cells = {b: c for (t, b), c in stats.items() if t == turn}
        if not cells:
            continue

        def tau(cs):
            n = sum(c[0] for c in cs)
            return (1 + sum(c[1] for c in cs) / n, n) if n else (None, 0)

        out[turn] = {"buckets": {b: tau([c]) for b, c in sorted(cells.items(), key=lambda kv: bucket_start(kv[0]))},
                     "all": tau(cells.values()),
                     f"before {cap}": tau([c for b, c in cells.items() if bucket_start(b) < cap])}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--heldout-sequences", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write both tables here as JSON")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from data.templates import apply_template_choice
    from export.io import read_json
    from export.load import load_export
    from inference.runtime.fallback import load_runtime
    from inference.served import load_prompts_for, measure
    from models.target import Target
    from models.zoo import resolve_target
    from train.config import config_from_dict
    from train.run import prepare_data

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    provenance = read_json(Path(args.export) / "draftsmith.json")
    cfg = config_from_dict(provenance["training_config"], [f"eval.num_sequences={args.heldout_sequences}"])
    k = cfg.eval.k
    path = resolve_target(cfg.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)
    drafter = load_export(args.export, dtype=dtype).to(device).eval()

    rt = load_runtime(path, dtype=dtype, device=device)
    questions = load_prompts_for(args.dataset, provenance, args.num_prompts)
    records = measure(rt, tokenizer, drafter, questions, k, args.max_new_tokens, 0.0, batch_size=args.batch_size)
    del rt
    target = Target.load(cfg.target, drafter.aux_layer_ids, dtype=dtype, device=device)
    served = walk(target, drafter, [(r["prompt"] + r["answer"], [0] * len(r["prompt"]) + [1] * len(r["answer"]), r["turn"])
                                    for r in records], k, device)
    _, heldouts, _, _ = prepare_data(cfg, tokenizer, AutoConfig.from_pretrained(path).vocab_size)
    heldout = next(iter(heldouts.values()))
    rows = heldout.select(range(min(args.heldout_sequences, len(heldout))))
    held = walk(target, drafter, [(r["input_ids"][: cfg.eval.max_length], r["loss_mask"][: cfg.eval.max_length], None)
                                  for r in rows], k, device)
    result = {"held-out": table(held, args.max_new_tokens), args.dataset: table(served, args.max_new_tokens)}
    for side, turns in result.items():
        for turn, t in turns.items():
            cells = ", ".join(f"{b}: {tau:.3f} ({n})" for b, (tau, n) in t["buckets"].items())
            capped = t[f"before {args.max_new_tokens}"]
            print(f"{side:>10} turn {turn:>2}: all {t['all'][0]:.3f} ({t['all'][1]} chains); before token "
                  f"{args.max_new_tokens}: {capped[0]:.3f}; by start token: {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
