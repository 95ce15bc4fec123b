"""python -m inference.deploy: what a drafter buys at each batch size, context length and target
precision, and the draft length per batch size written into a copy of the export.

    python -m inference.deploy --drafter runs/eagle3/export [--target T] [--dataset mt-bench] \
        [--num-prompts 20] [--max-new-tokens 256] [-k 2 4 7] [--tree D,K,N ...] [--fixed-k 4] \
        [--batch-sizes 1 2 4 8 16 32 64] [--context-dataset sharegpt] \
        [--context-buckets 512 2048 4096 8192] [--write-table-to DIR] [--device auto] [--out deploy]

Sections (report.json, report.md, one PNG each; docs/deploy.md):
- speed: plain and speculative tok/s at each batch size (greedy, the data set's first turns
  served B at a time, cycled to fill a batch), for each k the drafter can draft and each --tree;
  a batch size that runs out of device memory is recorded, and larger ones are not tried. The
  best choice per batch size, "off" included; the best chain (or off) per batch size is the
  table, whose rows [first_batch, last_batch, k] go into draftsmith.json (`k_table`) of a copy
  of the export with the server flags that read it. Then, with the table read back from that
  copy (export.io.read_k_table, what the runtime reads), each batch size is served again with
  the table's k and with a fixed k, one after the other.
- context: acceptance by preceding context, from long conversations of --context-dataset (each
  user turn after the conversation's own earlier turns): up to --num-prompts prompts per
  bucket, each answered by the runtime (measured) and replayed through training's predictor
  (predicted, inference/served.py replay's walk), both by the bucket of the context before the
  answer; the predictor's chains also by the context before each chain itself.
- precision: the same drafter against the target with its layer matrices rounded to FP8 e4m3
  (per-channel scales) and to 4-bit integers in groups of 128 (inference/quantize.py), served on
  the data set's prompts: tau and per-position acceptance against the target as loaded.
"""
from __future__ import annotations

import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

SECTIONS = ("speed", "context", "precision")
TABLE_COPY = "export-with-table"  # the copy of the export inside --out, unless --write-table-to


# ---------------------------------------------------------------- choices and the table (pure)
def option_k(name: str) -> int | None:
    """A speed option's chain length: "off" → 0, "k=N" → N, a tree → None."""
    if name == "off":
        return 0
    return int(name[2:]) if name.startswith("k=") else None


def best_choice(timings: dict[int, dict[str, float | None]], chains_only: bool = False) -> dict[int, dict]:
    """timings {batch: {option: tok/s, None where not measured}} with options "off", "k=N" and
    tree names → {batch: {choice, k, tokens_per_s, vs_plain}}: the fastest option at each batch
    measured with "off" (ties: off, then the shorter chain, then the order given). chains_only:
    among "off" and chains (what a draft-length table can say)."""
    out = {}
    for batch, options in timings.items():
        plain = options.get("off")
        if plain is None:
            continue
        measured = [(name, tps) for name, tps in options.items() if tps is not None
                    and (not chains_only or option_k(name) is not None)]
        rank = {name: (0 if option_k(name) is not None else 1, option_k(name) or 0, i) for i, (name, _) in enumerate(measured)}
        name, tps = max(measured, key=lambda nt: (nt[1], tuple(-x for x in rank[nt[0]])))
        out[batch] = {"choice": name, "k": option_k(name), "tokens_per_s": tps, "vs_plain": tps / plain}
    return out


def table_rows(k_by_batch: dict[int, int]) -> list[list[int]]:
    """{batch: k} at the batch sizes measured → [[first_batch, last_batch, k], ...]: each k from
    its batch to the next one measured (the first from batch 1), the last row ending at the
    largest batch measured; neighbours with the same k merged."""
    batches = sorted(k_by_batch)
    rows = []
    for i, b in enumerate(batches):
        lo = 1 if i == 0 else b
        hi = batches[i + 1] - 1 if i + 1 < len(batches) else b
        if rows and rows[-1][2] == k_by_batch[b]:
            rows[-1][1] = hi
        else:
            rows.append([lo, hi, k_by_batch[b]])
    return rows


def bucket_bounds(edges: list[int]) -> list[tuple[int, int]]:
    """Edges E1 < E2 < ... → buckets [0, E1), [E1, E2), ..."""
    bounds = [0, *edges]
    return list(zip(bounds[:-1], bounds[1:]))


def bucket_of(length: int, buckets: list[tuple[int, int]], clamp: bool = False) -> int | None:
    """The bucket holding `length` (clamp: past the last edge counts in the last bucket)."""
    for i, (lo, hi) in enumerate(buckets):
        if lo <= length < hi:
            return i
    return len(buckets) - 1 if clamp and length >= buckets[-1][1] else None


def bucket_label(bucket: tuple[int, int]) -> str:
    return f"< {bucket[1]}" if bucket[0] == 0 else f"{bucket[0]}-{bucket[1]}"


# ---------------------------------------------------------------- serving
def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def cycled_batches(prompts: list, batch: int) -> list[list]:
    """The prompts B at a time, taken in turn and cycled so that each batch is whole (at least one)."""
    n = max(1, math.ceil(len(prompts) / batch))
    return [[prompts[(i * batch + j) % len(prompts)] for j in range(batch)] for i in range(n)]


def serve(rt, batches, proposer, max_new: int, eos, max_len: int, device, verification: str = "standard",
          records: list | None = None) -> dict:
    """Every batch through the runtime with one proposer (None: plain): wall time, new tokens,
    the accepted-length histogram; records gets (prompt, answer, row histogram) per row."""
    from inference.runtime.engine import generate

    hist, tokens, outputs = None, 0, []
    _sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        outs, stats = generate(rt, batch, max_new, proposer=proposer, eos_ids=eos, max_len=max_len, verification=verification)
        tokens += sum(len(o) for o in outs)
        outputs.extend(outs)
        if stats.k:
            hist = stats.histogram if hist is None else [a + b for a, b in zip(hist, stats.histogram)]
        if records is not None:
            records.extend(zip(batch, outs, stats.row_histograms))
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "new_tokens": tokens, "histogram": hist,
            "outputs": outputs}


def _timed_option(rt, batches, make, max_new, eos, max_len, device, verification) -> dict:
    """One option at one batch size: built, warmed on a GPU (every batch for 2 tokens: prefill and
    step graphs captured outside the timing), then timed over every batch."""
    from models.acceptance import Acceptance

    proposer = make()
    if str(device).startswith("cuda"):  # (a CPU captures nothing)
        serve(rt, batches, proposer, 2, eos, max_len, device, verification)
    r = serve(rt, batches, proposer, max_new, eos, max_len, device, verification)
    r.pop("outputs")
    hist = r.pop("histogram")
    r["tau"] = Acceptance.from_histogram(hist).tau if hist else None
    r["verify_tokens_per_step"] = 1 + (getattr(proposer, "verify_tokens", None) or proposer.k) if proposer else 1
    return r


def speed_section(rt, module, prompts, eos, max_new, ks, trees, batch_sizes, max_len, device,
                  verification: str = "standard") -> dict:
    """{batch: {"options": {option: {tokens_per_s, seconds, new_tokens, tau, verify_tokens_per_step}}}
    or {"out_of_memory": message} / {"not_run": why}}, batch sizes ascending."""
    import torch

    from inference.proposers import drafter_proposer
    from inference.walks.tree import tree_label

    out, stopped = {}, None
    for batch in sorted(batch_sizes):
        if stopped:
            out[batch] = {"not_run": f"batch {stopped} ran out of device memory"}
            continue
        batches = cycled_batches(prompts, batch)
        options = {"off": lambda: None}
        for k in ks:
            options[f"k={k}"] = lambda k=k: drafter_proposer(module, k, batch, max_len, rt.config)
        for tree in trees:
            from inference.tree.loop import EagleTreeProposer

            options[f"tree {tree_label(tree)}"] = lambda t=tree: EagleTreeProposer(
                module, t[0], t[1], t[2], batch, max_len, rt.config, children=t[3] if len(t) > 3 else None)
        row = {}
        try:
            for name, make in options.items():
                row[name] = _timed_option(rt, batches, make, max_new, eos, max_len, device, verification)
                print(f"batch {batch:3d} {name:24s} {row[name]['tokens_per_s']:10.1f} tok/s"
                      + (f", tau {row[name]['tau']:.3f}" if row[name]["tau"] else ""), flush=True)
            out[batch] = {"options": row}
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            if not _out_of_memory(e):
                raise
            stopped = batch
            out[batch] = {"out_of_memory": str(e).splitlines()[0][:200], "options": row}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def table_vs_fixed(rt, module, prompts, eos, max_new, rows, fixed_k, batch_sizes, max_len, device, capability,
                   verification: str = "standard") -> dict:
    """Each batch size served with the k the table gives it (engine.draft_length, as the runtime
    reads its k_table) and with a fixed k, one after the other: {batch: {table_k, table, fixed, ratio}}."""
    from inference.proposers import drafter_proposer
    from inference.runtime.engine import draft_length

    out = {}
    for batch in batch_sizes:
        batches = cycled_batches(prompts, batch)
        k = draft_length(rows, batch, capability)
        made = {"table": (lambda: drafter_proposer(module, k, batch, max_len, rt.config)) if k else (lambda: None),
                "fixed": lambda: drafter_proposer(module, fixed_k, batch, max_len, rt.config)}
        r = {name: _timed_option(rt, batches, make, max_new, eos, max_len, device, verification)["tokens_per_s"]
             for name, make in made.items()}
        out[batch] = {"table_k": k, "fixed_k": fixed_k, "table_tokens_per_s": r["table"], "fixed_tokens_per_s": r["fixed"],
                      "table_vs_fixed": r["table"] / r["fixed"]}
        print(f"batch {batch:3d} table k={k}: {r['table']:.1f} tok/s, fixed k={fixed_k}: {r['fixed']:.1f} tok/s", flush=True)
    return out


# ---------------------------------------------------------------- the run
def run_deploy(drafter: str, target: str | None, dataset: str, num_prompts: int, max_new: int, ks: list[int],
               trees: list[tuple], batch_sizes: list[int], context_dataset: str, context_edges: list[int],
               out: Path, device: str, write_table_to: str | None = None, fixed_k: int | None = None,
               sections: tuple = SECTIONS, synthetic: float | None = None, kernels=None,
               accept_other_target: bool = False) -> dict:
    import torch
    from transformers import AutoTokenizer

    from data.chat import encode_prompt
    from data.sources import load_prompts
    from data.templates import trained_template
    from export.io import atomic_folder, read_k_table
    from export.load import check_target, load_export
    from inference.cli import check_fits, context_window
    from inference.deploy_acceptance import context_prompts, context_section, measure_acceptance, precision_section
    from inference.deploy_report import write_report, write_table_copy
    from inference.runtime.engine import CACHE_BUCKET, cache_size
    from inference.runtime.fallback import load_runtime
    from inference.validate import _export_target
    from models.methods import drafts_trees, max_drafts
    from models.target import Target
    from models.zoo import resolve_target

    target = target or _export_target(drafter)
    if not target:
        raise ValueError("--target: the export does not name its target; pass --target")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = resolve_target(target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trained_template(tokenizer, [drafter], target)
    window = context_window(path)
    questions = load_prompts(dataset)[:num_prompts]
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    for q, p in zip(questions, prompts):
        check_fits(len(p), max_new, window, f"prompt {q['id']} of {dataset}")
    module = load_export(drafter, dtype=dtype).to(device)
    other = check_target(drafter, path, accept_other_target)
    if other:
        print(f"note: {other}", file=sys.stderr)
    capability = max_drafts(module)
    ks = [k for k in ks if capability is None or k <= capability] or [capability]
    if trees and not drafts_trees(module):
        raise ValueError("--tree: this drafter's method does not draft EAGLE-2 trees")
    fixed_k = fixed_k or max(ks)
    if capability is not None and fixed_k > capability:
        raise ValueError(f"--fixed-k {fixed_k}: the drafter drafts at most {capability}")
    k_acc = max(ks)
    rt = load_runtime(path, dtype=dtype, device=device, kernels=kernels)
    eos = (tokenizer.eos_token_id,)
    verify_max = max([*ks, fixed_k, *(t[2] for t in trees)])
    max_len = -(-cache_size(prompts, max_new, verify_max) // CACHE_BUCKET) * CACHE_BUCKET
    acc_batch = 16 if device.startswith("cuda") else 1
    verification = f"synthetic:{synthetic}" if synthetic is not None else "standard"
    report = {"drafter": str(drafter), "target": target, "dataset": dataset, "num_prompts": len(prompts),
              "max_new_tokens": max_new, "k": ks, "fixed_k": fixed_k, "trees": [list(t) for t in trees],
              "batch_sizes": sorted(batch_sizes), "sections": list(sections), "synthetic_acceptance": synthetic,
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "dtype": str(dtype),
              "acceptance_batch_size": acc_batch, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "kernels": rt.kernels.record() if hasattr(rt, "kernels") else None}
    with atomic_folder(out, tool="deploy", keep=(drafter,)) as tmp:
        if "speed" in sections:
            speed = speed_section(rt, module, prompts, eos, max_new, ks, trees, batch_sizes, max_len, device, verification)
            timings = {b: {name: o["tokens_per_s"] for name, o in r.get("options", {}).items()} for b, r in speed.items()
                       if "options" in r and "out_of_memory" not in r}
            best, chains = best_choice(timings), best_choice(timings, chains_only=True)
            report["speed"] = {str(b): r for b, r in speed.items()}
            report["best"] = {str(b): c for b, c in best.items()}
            if chains:
                rows = table_rows({b: c["k"] for b, c in chains.items()})
                table = {"rows": rows, "choices": {str(b): c["choice"] for b, c in chains.items()},
                         "tokens_per_s": {str(b): c["tokens_per_s"] for b, c in chains.items()},
                         "vs_plain": {str(b): c["vs_plain"] for b, c in chains.items()}, "batch_sizes": sorted(chains),
                         "target": target, "dataset": dataset, "device": report["device"], "date": report["date"],
                         "synthetic_acceptance": synthetic, "made_by": "python -m inference.deploy"}
                where = Path(write_table_to) if write_table_to else out / TABLE_COPY
                copy, lines, notes = write_table_copy(Path(drafter), where, table, None if write_table_to else tmp / TABLE_COPY)
                report["table"] = {**table, "copy": str(where), "launch_lines": lines, "notes": notes}
                # the table as the runtime reads it, back from the copy
                report["table_vs_fixed"] = {str(b): r for b, r in table_vs_fixed(
                    rt, module, prompts, eos, max_new, read_k_table(copy), fixed_k, sorted(chains), max_len, device,
                    capability or verify_max, verification).items()}
        if "precision" in sections:
            report["precision"] = precision_section(rt, module, prompts, k_acc, max_new, eos, acc_batch, device)
        if "context" in sections:
            buckets = bucket_bounds(context_edges)
            longest = (window or 1 << 30) - max_new - k_acc - 1
            found = context_prompts(tokenizer, context_dataset, buckets, num_prompts, longest)
            found.sort(key=lambda p: len(p["prompt"]))  # batches of like lengths pad little
            records = measure_acceptance(rt, module, [p["prompt"] for p in found], k_acc, max_new, eos, acc_batch, device)
            del rt
            tgt = Target.load(target, module.aux_layer_ids, dtype=dtype, device=device)
            report["context"] = {**context_section(records, buckets, tgt, module, k_acc),
                                 "dataset": context_dataset, "longest_prompt": longest}
            for b in report["context"]["buckets"]:
                if not b["answers"]:
                    b["note"] = (f"beyond the target's window ({window} tokens with {max_new} new)" if b["bucket"][0] >= longest
                                 else f"no user turn of {context_dataset} with this much context before it")
        write_report(report, tmp)
    return report


def main(argv=None) -> int:
    """The command; the --out lock it takes is given back however it ends."""
    from export.io import release_output_locks

    try:
        return _main(argv)
    finally:
        release_output_locks()


def _main(argv=None) -> int:
    from inference.cli import CliError, Parser, add_kernel_flags, check_new_tokens_fit, check_output_folder, \
        check_ranges, kernel_settings, parse_tree_spec, positive, resolve_device

    ap = Parser(prog="python -m inference.deploy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="export folder")
    ap.add_argument("--target", default=None, help="default: the target named in the export")
    ap.add_argument("--dataset", default="mt-bench", help="prompts served for the speed and precision sections: "
                    "mt-bench, humaneval or a JSON/JSONL file (first turns)")
    ap.add_argument("--num-prompts", type=int, default=20, help="prompts of --dataset; and per context bucket")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    ap.add_argument("-k", type=int, nargs="+", default=[2, 4, 7], help="draft lengths timed (those the drafter can "
                    "draft); the largest is the one the acceptance sections serve")
    ap.add_argument("--tree", action="append", default=[], metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="also time EAGLE-2 trees (EAGLE-3 drafters; repeatable); a best choice, not a table row")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                    help="batch sizes timed, as far as device memory allows")
    ap.add_argument("--fixed-k", type=int, default=None, help="the fixed k the table is served against (unset: the "
                    "largest -k)")
    ap.add_argument("--context-dataset", default="sharegpt", help="conversations with answers for the context section: "
                    "sharegpt, a chat file or a hub data set")
    ap.add_argument("--context-buckets", type=int, nargs="+", default=[512, 2048, 4096, 8192], metavar="EDGE",
                    help="bucket edges of preceding context in tokens: [0, E1), [E1, E2), ...")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="what to measure")
    ap.add_argument("--synthetic-acceptance", type=float, default=None, metavar="RATE",
                    help="speed section only: accept each draft with probability RATE instead of verifying it "
                         "(a random-weight target's speed at a given acceptance); the table then says so")
    ap.add_argument("--write-table-to", default=None, metavar="DIR",
                    help="a new folder for the copy of the export with the table (unset: --out/export-with-table)")
    ap.add_argument("--accept-other-target", action="store_true",
                    help="serve with a target whose weights differ from the one the drafter was trained against")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    add_kernel_flags(ap)
    ap.add_argument("--out", default="deploy", help="folder for report.json, report.md, the charts and the table's copy")
    args = ap.parse_args(argv)
    try:
        check_ranges(args, {"num_prompts": positive, "max_new_tokens": positive, "fixed_k": positive})
        for flag, values in (("-k", args.k), ("--batch-sizes", args.batch_sizes), ("--context-buckets", args.context_buckets)):
            if min(values) < 1:
                raise CliError(f"{flag}: must be positive, got {min(values)}")
        if args.context_buckets != sorted(set(args.context_buckets)):
            raise CliError(f"--context-buckets: edges must be increasing, got {args.context_buckets}")
        if args.synthetic_acceptance is not None and not 0 <= args.synthetic_acceptance <= 1:
            raise CliError(f"--synthetic-acceptance: must be in [0, 1], got {args.synthetic_acceptance}")
        if args.synthetic_acceptance is not None and args.tree:
            raise CliError("--synthetic-acceptance: trees are verified against the target only (leave --tree out)")
        trees = [parse_tree_spec(spec) for spec in args.tree]
        device = resolve_device(args.device)
        kernels = kernel_settings(args, device)
        if not (Path(args.drafter) / "config.json").is_file():
            raise CliError(f"--drafter: {args.drafter} is not an export folder (no config.json)")
        check_output_folder(args.out, tool="deploy", keep=(args.drafter,))
        if args.write_table_to:
            _check_new_folder(args.write_table_to, args.drafter, args.out)
        from inference.validate import _export_target

        check_new_tokens_fit(args.target or _export_target(args.drafter), args.max_new_tokens)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from data.sources import DataError
    from models.zoo import AssetError

    try:
        report = run_deploy(args.drafter, args.target, args.dataset, args.num_prompts, args.max_new_tokens,
                            sorted(set(args.k)), trees, sorted(set(args.batch_sizes)), args.context_dataset,
                            args.context_buckets, Path(args.out), device, args.write_table_to, args.fixed_k,
                            tuple(args.sections), args.synthetic_acceptance, kernels, args.accept_other_target)
    except (DataError, AssetError, ValueError, KeyError, OSError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    from inference.deploy_report import summary_lines

    print("\n".join(summary_lines(report, args.out)))
    return 0


def _check_new_folder(folder: str, drafter: str, out: str) -> None:
    """--write-table-to: a new (or empty) folder, never the export itself nor inside it, and apart
    from --out (which is replaced whole)."""
    from inference.cli import CliError

    dest = Path(folder)
    if dest.resolve().is_relative_to(Path(out).resolve()) or Path(out).resolve().is_relative_to(dest.resolve()):
        raise CliError(f"--write-table-to: {folder} and --out {out} must be apart (--out is replaced whole)")
    if dest.resolve() == Path(drafter).resolve() or dest.resolve().is_relative_to(Path(drafter).resolve()):
        raise CliError(f"--write-table-to: {folder} is the export (or inside it); the table goes into a copy, never "
                       "into the export itself")
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise CliError(f"--write-table-to: {folder} exists and is not an empty folder; choose a new folder")
    from export.paths import OutputPathError, check_writable

    try:
        check_writable(dest, "--write-table-to")
    except OutputPathError as e:
        raise CliError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
