"""python -m inference.bench: decoders side by side, same prompts, same process.

Rows: transformers' `generate` (plain, and with prompt lookup), this runtime plain, and this
runtime with each proposer (n-gram, suffix decoding; EAGLE-3 with --drafter). Batch 1, greedy. Reports tok/s,
tau, ratios against transformers plain and runtime plain, and how many outputs equal the
runtime's plain output (exact in float32; bf16 batching may flip near-ties). Writes
bench.json and bench.png to --out.

    python -m inference.bench --target smollm2-135m-instruct --dataset mt-bench --num-prompts 20 \
        --max-new-tokens 256 [--drafter runs/eagle3/export] [-k 4] [--out bench/]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def _without_kernels(fn):
    """Run fn with every runtime kernel replaced by its torch reference (same graphs otherwise)."""
    import os

    saved = os.environ.get("DRAFTSMITH_KERNELS")
    os.environ["DRAFTSMITH_KERNELS"] = "0"
    try:
        return fn()
    finally:
        if saved is None:
            del os.environ["DRAFTSMITH_KERNELS"]
        else:
            os.environ["DRAFTSMITH_KERNELS"] = saved


def run_bench(target: str, prompts_spec: str, num_prompts: int, max_new: int, k: int, drafter: str | None,
              device: str, out_dir: Path, hf_static: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.chat import encode_prompt
    from data.sources import load_prompts
    from inference.engine import cache_size, generate
    from inference.model import load_runtime
    from inference.proposers import GpuNgramProposer, NgramProposer, SuffixProposer, drafter_proposer
    from models.zoo import resolve_target

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = resolve_target(target)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tok, [{"role": "user", "content": q["turns"][0]}]) for q in load_prompts(prompts_spec)[:num_prompts]]
    eos = (tok.eos_token_id,)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    rt = load_runtime(path, dtype=dtype, device=device)
    drafter_module = None
    if drafter:
        from export.load import load_export

        drafter_module = load_export(drafter, dtype=dtype).to(device)
        drafter_proposer(drafter_module, k, 1, 8, rt.config)  # refuses a drafter for another target

    def hf_generate(**kw):
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
            outs.append(out[0, len(p):].tolist())
        return outs, None

    def runtime(make_proposer):
        outs, hist = [], None
        for p in prompts:
            proposer = make_proposer(p)
            o, stats = generate(rt, [p], max_new, proposer=proposer, eos_ids=eos)
            outs.append(o[0])
            if proposer is not None:
                hist = stats.histogram if hist is None else [a + b for a, b in zip(hist, stats.histogram)]
        return outs, hist

    def suffix_row():
        suffix = SuffixProposer(k)  # fresh per run: its global cache grows prompt by prompt within it
        return runtime(lambda p: suffix)

    rows = {
        "transformers generate": lambda: hf_generate(),
        "transformers prompt lookup": lambda: hf_generate(prompt_lookup_num_tokens=10),
        "runtime plain": lambda: runtime(lambda p: None),
        "runtime plain, torch ops (DRAFTSMITH_KERNELS=0)": lambda: _without_kernels(lambda: runtime(lambda p: None)),
        f"runtime n-gram (k={k})": lambda: runtime(lambda p: NgramProposer(k)),
        f"runtime n-gram on the device (k={k})": lambda: runtime(
            lambda p: GpuNgramProposer(k, 1, cache_size([p], max_new, k), device=device)),
        f"runtime suffix (k={k})": lambda: suffix_row(),
    }
    if hf_static:
        rows["transformers static cache (compiled)"] = lambda: hf_generate(cache_implementation="static")
    if drafter_module is not None:
        name = type(drafter_module).__name__.removesuffix("Drafter").replace("Eagle3", "EAGLE-3")
        rows[f"runtime {name} (k={k})"] = lambda: runtime(
            lambda p: drafter_proposer(drafter_module, k, 1, cache_size([p], max_new, k), rt.config))

    from inference.acceptance import acceptance_from_histogram

    # one warm-up prompt per row (kernels, graphs, allocator) outside the timing
    saved = prompts[:]
    prompts[:] = saved[:1]
    for fn in rows.values():
        fn()
    prompts[:] = saved
    results = {}
    for name, fn in rows.items():
        (outs, hist), sec = _timed(fn)
        n_tokens = sum(len(o) for o in outs)
        results[name] = {"tokens_per_s": n_tokens / sec, "seconds": sec, "new_tokens": n_tokens, "outputs": outs}
        if hist is not None:
            results[name]["acceptance"] = acceptance_from_histogram(hist)
        print(f"{name:40s} {n_tokens / sec:10.1f} tok/s", flush=True)
    hf_tps = results["transformers generate"]["tokens_per_s"]
    plain = results["runtime plain"]
    for r in results.values():
        r["vs_transformers"] = r["tokens_per_s"] / hf_tps
        r["vs_runtime_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["outputs_equal_runtime_plain"] = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
    summary = {
        "target": target, "prompts": prompts_spec, "num_prompts": len(prompts), "max_new_tokens": max_new,
        "k": k, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
        "rows": {name: {kk: vv for kk, vv in r.items() if kk != "outputs"} for name, r in results.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=2))
    _chart(summary, out_dir / "bench.png")
    return summary


def _chart(summary: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["rows"])
    tps = [summary["rows"][n]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    bars = ax.barh(names, tps, color="#4878a8")
    for bar, n in zip(bars, names):
        r = summary["rows"][n]
        label = f" {r['tokens_per_s']:.0f} tok/s ({r['vs_transformers']:.1f}x)"
        if "acceptance" in r:
            label += f", tau {r['acceptance']['tau']:.2f}"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (batch 1, greedy)")
    ax.set_title(f"{summary['target']} on {summary['prompts']} ({summary['num_prompts']} prompts, {summary['device']})", fontsize=9)
    ax.set_xlim(0, max(tps) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inference.bench")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval or a JSON/JSONL file of prompts")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--drafter", help="EAGLE-3 export folder")
    ap.add_argument("--hf-static", action="store_true", help="also time transformers' compiled static-cache generate")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.drafter and not (Path(args.drafter) / "config.json").is_file():
        print(f"error: --drafter: {args.drafter} is not an export folder (no config.json)", file=sys.stderr)
        return 2
    try:
        run_bench(args.target, args.dataset, args.num_prompts, args.max_new_tokens, args.k, args.drafter, device,
                  Path(args.out), hf_static=args.hf_static)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
