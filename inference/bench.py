"""python -m inference.bench: decoders side by side, same prompts, same process.

Rows: transformers' `generate` (plain, and with prompt lookup), this runtime plain, and this
runtime with each proposer (n-gram, suffix decoding, and every drafter given with --drafter, at
each -k it can draft). Batch 1, greedy; --batch-size B adds plain and each drafter serving B
prompts at once. Reports tok/s, tau, ratios against transformers plain and runtime plain (at
the same batch), where a speculative step's time goes (draft / verify / other ms per step, host
syncs per token), and how many outputs equal the runtime's plain output (exact in float32; bf16
batching may flip near-ties). --tree DEPTH,TOPK,NODES (repeatable) adds EAGLE-2 tree rows for
each EAGLE-3 drafter; of the trees swept, the fastest on this target and device is printed and
kept in bench.json (`best_tree`) beside the same drafter's chain at that depth (else its
fastest chain): tok/s, tau and the tokens verified per step of each. Writes bench.json and
bench.png to --out. --repeats R times the runtime's rows R times, each pass every row in turn, and
keeps each row's median pass (a ratio between rows is then less one process's luck).

    python -m inference.bench --target smollm2-135m-instruct --dataset mt-bench --num-prompts 20 \
        --max-new-tokens 256 [--drafter runs/eagle3/export runs/dflash/export ...] [-k 4 7] \
        [--batch-size 16] [--out bench/]
"""
from __future__ import annotations

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


TORCH_OPS_ROW = "runtime plain, torch ops (--kernels off)"


def _drafter_name(module) -> str:
    from models.methods import display_name

    return display_name(module)  # its method's row (models/methods.py)


def _drafter_ks(module, ks: list[int]) -> list[int]:
    """The requested draft lengths this drafter can draft (its method row's max_drafts: MTP its
    modules, DFlash B-1, Medusa its heads); one at its capability when none of them fits."""
    from models.methods import max_drafts

    cap = max_drafts(module)
    if cap is None:
        return list(ks)
    fitting = [k for k in ks if k <= cap]
    return fitting or [cap]


def _tree_row(tree) -> str:
    from inference.walks.tree import tree_words

    return f"runtime EAGLE-3 tree ({tree_words(tree)})"


def best_tree_setting(rows: dict, trees, ks, target: str, device: str) -> dict | None:
    """The swept tree with the highest tok/s on this target and device (ties: the first given),
    beside the same EAGLE-3 drafter's chain at the tree's depth (else its fastest chain): tok/s,
    tau and the verify tokens per step (root + nodes, root + k) of each, and their ratios.
    rows: bench.json's rows; None when no tree row was measured."""
    swept = [(tuple(t), rows[_tree_row(t)]) for t in trees if _tree_row(t) in rows]
    if not swept:
        return None

    def side(name, r):
        return {"row": name, "tokens_per_s": r["tokens_per_s"], "tau": (r.get("acceptance") or {}).get("tau"),
                "verify_tokens_per_step": r["verify_tokens_per_step"], "vs_runtime_plain": r.get("vs_runtime_plain")}

    tree, row = max(swept, key=lambda tr: tr[1]["tokens_per_s"])
    chains = {k: f"runtime EAGLE-3 (k={k})" for k in ks if f"runtime EAGLE-3 (k={k})" in rows}
    chain_k = tree[0] if tree[0] in chains else max(chains, key=lambda k: rows[chains[k]]["tokens_per_s"], default=None)
    best = {"target": target, "device": device, "tree": dict(zip(("depth", "top_k", "total_tokens", "children"), tree)),
            **side(_tree_row(tree), row), "chain": None, "tree_vs_chain": None,
            "swept": [{"tree": list(t), **side(_tree_row(t), r)} for t, r in swept]}
    if chain_k is not None:
        chain = rows[chains[chain_k]]
        best["chain"] = {"k": chain_k, **side(chains[chain_k], chain)}
        best["tree_vs_chain"] = {"tokens_per_s": row["tokens_per_s"] / chain["tokens_per_s"],
                                 "tau": (best["tau"] / best["chain"]["tau"]) if best["tau"] and best["chain"]["tau"] else None}
    return best


def _best_tree_line(best: dict) -> str:
    from inference.walks.tree import tree_words

    t, c = best["tree"], best["chain"]
    tau = (lambda x: "-" if x is None else f"{x:.3f}")
    line = (f"best tree on {best['target']} ({best['device']}, of {len(best['swept'])} swept): "
            f"{tree_words(tuple(t.values()))}: {best['tokens_per_s']:.1f} tok/s, tau {tau(best['tau'])}, "
            f"{best['verify_tokens_per_step']} verify tokens per step")
    if c is not None:
        ratio = best["tree_vs_chain"]
        line += (f"; chain k={c['k']}: {c['tokens_per_s']:.1f} tok/s, tau {tau(c['tau'])}, {c['verify_tokens_per_step']} "
                 f"verify tokens per step; tree/chain {ratio['tokens_per_s']:.2f}x tok/s"
                 + (f", {ratio['tau']:.2f}x tau" if ratio["tau"] else ""))
    return line


def run_bench(target: str, prompts_spec: str, num_prompts: int, max_new: int, ks: list[int], drafters: list[str],
              device: str, out_dir: Path, hf_static: bool = False, batch_size: int = 0, hf_prompts: int | None = None,
              trees: list[tuple[int, int, int]] = (), repeats: int = 1, kernels=None,
              accept_other_target: bool = False, adaptive: str | None = None) -> dict:
    """kernels: the runtime's kernel settings (kernels/settings.py KernelSettings; default: the
    defaults), recorded in bench.json; the "torch ops" row runs the same with the mode "off".

    adaptive: a step-cost table's JSON file or "measure" (inference/runtime/adaptive.py): each
    drafter with a confidence head (DSpark) also gets rows with adaptive verification, beside its
    fixed-k rows; the table each used is in bench.json (`step_costs`, by row), and a measured one is
    also saved as step_costs.json in the output folder."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data.chat import encode_prompt
    from data.templates import trained_template
    from data.sources import load_prompts
    from inference.runtime.engine import CACHE_BUCKET, GenerationStats, cache_size, generate
    from inference.runtime.fallback import load_runtime
    from inference.proposers import GpuNgramProposer, NgramProposer, SuffixProposer, drafter_proposer
    from draftsmith_kernels.settings import KernelSettings
    from models.methods import drafts_trees
    from models.zoo import resolve_target

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = resolve_target(target)
    tok = AutoTokenizer.from_pretrained(path)
    trained_template(tok, drafters, target)  # a base model's template, as the drafters were trained
    questions = load_prompts(prompts_spec)[:num_prompts]
    prompts = [encode_prompt(tok, [{"role": "user", "content": q["turns"][0]}]) for q in questions]
    eos = (tok.eos_token_id,)
    from inference.cli import check_fits, context_window

    context = context_window(path)
    for q, p in zip(questions, prompts):  # every prompt + its new tokens inside the context window
        check_fits(len(p), max_new, context, f"prompt {q['id']} of {prompts_spec}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    kernels = kernels or KernelSettings()
    torch_ops = dataclasses.replace(kernels, mode="off")  # every kernel's torch reference, the same graphs otherwise
    rt = load_runtime(path, dtype=dtype, device=device, kernels=kernels)
    k_max = max([*ks, *(t[2] for t in trees)])  # a tree verifies its N nodes after the root
    # one cache length for every prompt and row: each row captures its graphs once, in the warm-up
    max_len = -(-cache_size(prompts, max_new, k_max) // CACHE_BUCKET) * CACHE_BUCKET
    modules = []
    if drafters:
        from export.load import load_export

        for folder in drafters:
            module = load_export(folder, dtype=dtype).to(device)
            from export.load import check_target

            other_target = check_target(folder, path, accept_other_target)
            if other_target:
                print(f"note: {other_target}", file=sys.stderr)
            drafter_proposer(module, _drafter_ks(module, ks)[0], 1, 8, rt.config)  # refuses a drafter for another target
            modules.append(module)

    hf_subset = prompts[: hf_prompts or len(prompts)]

    def hf_generate(**kw):
        outs = []
        for p in hf_subset:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
            outs.append(out[0, len(p):].tolist())
        return outs, None

    new_tokens = [max_new]  # what runtime rows generate per prompt (the warm-up asks for a few)

    def runtime(proposer, batch: int = 1, settings=None, adaptive_setting=None):
        """Every prompt through the runtime, `batch` at a time, with one proposer (built for
        that batch and reused: its graphs are captured once), under the kernel settings `settings`
        (default: the runtime's). Returns outputs and the summed stats."""
        outs, total = [], GenerationStats(k=proposer.k if proposer is not None else 0)
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            if len(chunk) != batch:
                continue  # a batched row serves whole batches only (its proposer is built for B rows)
            o, stats = generate(rt, chunk, new_tokens[0], proposer=proposer, eos_ids=eos, max_len=max_len, kernels=settings,
                                adaptive=adaptive_setting)
            outs.extend(o)
            total.steps += stats.steps
            total.new_tokens += stats.new_tokens
            total.histogram = [a + b for a, b in zip(total.histogram, stats.histogram)] if total.histogram else stats.histogram
            total.draft_seconds += stats.draft_seconds
            total.verify_seconds += stats.verify_seconds
            total.total_seconds += stats.total_seconds
            total.host_syncs += stats.host_syncs
            total.setup_seconds += stats.setup_seconds
            total.launch_seconds += stats.launch_seconds
            total.launched_steps += stats.launched_steps
            if stats.verified_drafts is not None:
                total.verified_drafts = (total.verified_drafts or 0) + stats.verified_drafts
            total.device_loop, total.verify_tokens, total.graphed = stats.device_loop, stats.verify_tokens, stats.graphed
        return outs, total

    def suffix_row():
        # fresh per run: its global cache grows prompt by prompt within it; the longest chain's k
        # (not a tree's node count, which only sizes the caches)
        return runtime(SuffixProposer(max(ks)))

    rows = {
        "transformers generate": lambda: hf_generate(),
        "transformers prompt lookup": lambda: hf_generate(prompt_lookup_num_tokens=10),
        "runtime plain": lambda: runtime(None),
        TORCH_OPS_ROW: lambda: runtime(None, settings=torch_ops),
    }
    if hf_static:
        rows["transformers static cache (compiled)"] = lambda: hf_generate(cache_implementation="static")
    for k in ks:
        rows[f"runtime n-gram (k={k})"] = lambda k=k: runtime(NgramProposer(k))
        ngram_gpu = GpuNgramProposer(k, 1, max_len, device=device)
        rows[f"runtime n-gram on the device (k={k})"] = lambda p=ngram_gpu: runtime(p)
    rows[f"runtime suffix (k={max(ks)})"] = suffix_row
    for module in modules:
        for k in _drafter_ks(module, ks):
            proposer = drafter_proposer(module, k, 1, max_len, rt.config)
            rows[f"runtime {_drafter_name(module)} (k={k})"] = lambda p=proposer: runtime(p)
        for tree in trees if drafts_trees(module) else ():
            from inference.tree.loop import EagleTreeProposer

            depth, top_k, total, *children = tree
            proposer = EagleTreeProposer(module, depth, top_k, total, 1, max_len, rt.config,
                                         children=children[0] if children else None)
            rows[_tree_row(tree)] = lambda p=proposer: runtime(p)
    if batch_size > 1:
        rows[f"runtime plain, batch {batch_size}"] = lambda: runtime(None, batch_size)
        for module in modules:
            k = _drafter_ks(module, ks)[0]
            proposer = drafter_proposer(module, k, batch_size, max_len, rt.config)
            rows[f"runtime {_drafter_name(module)} (k={k}), batch {batch_size}"] = lambda p=proposer: runtime(p, batch_size)
    step_costs = {}  # row name → the step-cost table its adaptive verification priced steps with
    if adaptive is not None:
        step_costs = _adaptive_rows(rows, modules, ks, batch_size, adaptive, rt, prompts, new_tokens, max_len, target,
                                    runtime, out_dir)

    from inference.walks.greedy import acceptance_from_histogram

    # every prefill shape once, outside the timing (a GPU captures each padded prompt length
    # once), with the kernels and with torch ops
    def prefill_all(settings=None):
        for batch in sorted({1, batch_size or 1}):
            for i in range(0, len(prompts) - batch + 1, batch):
                generate(rt, prompts[i : i + batch], 1, eos_ids=eos, max_len=max_len, kernels=settings)

    prefill_all()
    prefill_all(torch_ops)
    # outside the timing, every row once: transformers on its prompts; the runtime's rows on
    # every prompt for a few tokens (each prompt length's prefill graph with the row's aux
    # layers, the proposer's setup kernels, the step's graphs), then one whole answer (a whole
    # batch for batched rows). Warmed on one prompt only, a row would time the captures of the
    # other prompt lengths into its first answers.
    saved = prompts[:]
    for name, fn in rows.items():
        if name.startswith("runtime"):
            new_tokens[0] = 4
            fn()
            new_tokens[0] = max_new
        prompts[:] = saved[: batch_size if name.endswith(f"batch {batch_size}") else 1]
        fn()
        prompts[:] = saved
    # `repeats` passes over the runtime's rows, each pass every row in turn (a drift of the GPU's
    # speed meets every row alike); each row keeps its median pass. transformers' rows run once.
    passes = {name: [] for name in rows}
    for p in range(repeats):
        for name, fn in rows.items():
            if p and not name.startswith("runtime"):
                continue
            passes[name].append(_timed(fn))
            (outs, _), sec = passes[name][-1]  # (progress: the rows' full lines follow the last pass)
            print(f"pass {p + 1}/{repeats}: {name} {sum(len(o) for o in outs) / sec:.1f} tok/s", flush=True)
    results = {}
    for name, timed in passes.items():
        speeds = [sum(len(o) for o in outs) / sec for (outs, _), sec in timed]
        # the median pass (of an even count, the slower of the middle two)
        (outs, stats), sec = timed[sorted(range(len(speeds)), key=speeds.__getitem__)[(len(speeds) - 1) // 2]]
        n_tokens = sum(len(o) for o in outs)
        r = results[name] = {"tokens_per_s": n_tokens / sec, "seconds": sec, "new_tokens": n_tokens, "outputs": outs,
                             "verify_tokens_per_step": None if stats is None else (
                                 1 + (getattr(stats, "verify_tokens", None) or stats.k)),
                             "batch": batch_size if name.endswith(f"batch {batch_size}") else 1,
                             "prompts": len(outs), "kernels": None}  # (the runtime's rows: their mode, below)
        if name.startswith("runtime"):
            r["kernels"] = (torch_ops if name == TORCH_OPS_ROW else kernels).mode
        if len(speeds) > 1:
            r["tokens_per_s_passes"] = speeds
        line = f"{name:52s} {n_tokens / sec:10.1f} tok/s"
        if len(speeds) > 1:
            line += f" (median of {len(speeds)}: {min(speeds):.1f}-{max(speeds):.1f})"
        if name in step_costs:
            r["adaptive_verification"] = True
        if stats is not None:
            split = stats.summary()
            if split.get("verified_drafts_per_row_step") is not None:
                r["verified_drafts_per_row_step"] = split["verified_drafts_per_row_step"]
            r["split"] = {key: split[key] for key in ("steps", "draft_ms_per_step", "verify_ms_per_step", "other_ms_per_step",
                                                       "host_launch_ms_per_step", "setup_seconds", "launched_steps",
                                                       "host_syncs_per_token", "device_loop", "graphed")}
            line += (f"  draft {split['draft_ms_per_step']:.3f} / verify {split['verify_ms_per_step']:.3f} / other "
                     f"{split['other_ms_per_step']:.3f} ms per step, {split['host_syncs_per_token']:.3f} syncs per token")
            if split["device_loop"]:  # what "other" holds: the setup, and the host's launch time to compare
                line += (f" (host launches {split['host_launch_ms_per_step']:.3f} ms per step, setup "
                         f"{1e3 * split['setup_seconds'] / max(r['prompts'], 1):.1f} ms per prompt)")
            if stats.k:
                r["acceptance"] = acceptance_from_histogram(stats.histogram)
                line += f", tau {r['acceptance']['tau']:.3f}"
        print(line, flush=True)
    hf_tps = results["transformers generate"]["tokens_per_s"]
    plain = results["runtime plain"]
    for name, r in results.items():
        same_batch = results.get(f"runtime plain, batch {r['batch']}", plain) if r["batch"] > 1 else plain
        r["vs_transformers"] = r["tokens_per_s"] / hf_tps
        r["vs_runtime_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["vs_runtime_plain_same_batch"] = r["tokens_per_s"] / same_batch["tokens_per_s"]
        r["outputs_equal_runtime_plain"] = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
    summary = {
        "target": target, "prompts": prompts_spec, "num_prompts": len(prompts), "max_new_tokens": max_new,
        "k": ks, "transformers_prompts": len(hf_subset), "batch_size": batch_size,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(dtype),
        **kernels.record(),  # the kernels' mode and the tree-attention tuning (--kernels, --tree-attention)
        "rows": {name: {kk: vv for kk, vv in r.items() if kk != "outputs"} for name, r in results.items()},
        "step_costs": {name: costs.to_dict() for name, costs in step_costs.items()} or None,
    }
    # the sweep's best tree for this target and device, beside the same drafter's chain
    summary["best_tree"] = best_tree_setting(summary["rows"], trees, ks, target, summary["device"])
    print(f"{'row':52s} {'tok/s':>9s} {'vs plain':>9s} {'vs HF':>7s} {'tau':>6s}  = plain")
    for name, r in summary["rows"].items():
        tau = f"{r['acceptance']['tau']:.3f}" if "acceptance" in r else "-"
        print(f"{name:52s} {r['tokens_per_s']:9.1f} {r['vs_runtime_plain_same_batch']:8.2f}x {r['vs_transformers']:6.1f}x "
              f"{tau:>6s}  {r['outputs_equal_runtime_plain']}/{r['prompts']}")
    if summary["best_tree"] is not None:
        print(_best_tree_line(summary["best_tree"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(summary, indent=2))
    _chart(summary, out_dir / "bench.png")
    return summary


def _adaptive_rows(rows, modules, ks, batch_size, spec, rt, prompts, new_tokens, max_len, target, runtime, out_dir) -> dict:
    """Rows with adaptive verification for each drafter with a confidence head, at batch 1 and
    `batch_size`, beside its fixed-k rows; returns {row name: StepCosts}. `spec` "measure": the
    target's verify steps timed here (k + 1 tokens per row at most, inference/runtime/adaptive.py)
    and each drafter's draft step timed after a short generation; saved as step_costs.json."""
    import dataclasses

    from inference.proposers import capabilities, drafter_proposer
    from inference.runtime.adaptive import AdaptiveVerification, StepCosts, measure_step_costs
    from inference.runtime.engine import generate

    batches = sorted({1, batch_size or 1})
    chosen = {}
    for module in modules:
        k = _drafter_ks(module, ks)[0]
        made = {b: drafter_proposer(module, k, b, max_len, rt.config) for b in batches}
        if not capabilities(made[1]).confidences:
            continue
        if spec == "measure":
            draft_ms = {}
            for b, proposer in made.items():  # the proposer's phase (advance and draft) per step, as the loop times it
                for _ in range(2):  # the second call replays the graphs the first captured
                    _, stats = generate(rt, prompts[:b], min(8, new_tokens[0]), proposer=proposer, eos_ids=(),
                                        max_len=max_len)
                draft_ms[b] = 1e3 * stats.draft_seconds / max(stats.launched_steps, 1)
            costs = measure_step_costs(rt, batches, k + 1, capabilities(made[1]).aux_layers, target=target,
                                       draft_ms=draft_ms)
        else:
            costs = StepCosts.load(spec)
        for b, proposer in made.items():
            try:  # a table too short for k: refused before any row runs
                costs.row(b, k)
            except ValueError as e:
                raise ValueError(f"--adaptive-verification: {e}") from None
            name = f"runtime {_drafter_name(module)} (k={k}), adaptive" + (f", batch {b}" if b > 1 else "")
            rows[name] = lambda p=proposer, b=b, c=costs: runtime(p, b, adaptive_setting=AdaptiveVerification(c))
            chosen[name] = costs
    if not chosen:  # the flag would time nothing: said, not skipped
        raise ValueError("--adaptive-verification: no --drafter has a confidence head, which adaptive verification "
                         "reads (a DSpark drafter trained with drafter.dspark.confidence_head=true)")
    if spec == "measure":  # (the first such drafter's: bench.json holds every row's)
        from export.io import atomic_write_json

        atomic_write_json(out_dir / "step_costs.json", next(iter(chosen.values())).to_dict())
    return chosen


def _chart(summary: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["rows"])
    tps = [summary["rows"][n]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(names) + 1.5))
    bars = ax.barh(names, tps, color="#4878a8")
    for bar, n in zip(bars, names):
        r = summary["rows"][n]
        label = f" {r['tokens_per_s']:.0f} tok/s ({r['vs_runtime_plain_same_batch']:.2f}x plain)"
        if "acceptance" in r:
            label += f", tau {r['acceptance']['tau']:.2f}"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (greedy; batch 1 unless named)")
    ax.set_title(f"{summary['target']} on {summary['prompts']} ({summary['num_prompts']} prompts, {summary['device']})", fontsize=9)
    ax.set_xlim(0, max(tps) * 1.6)  # room for the longest label right of the longest bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from inference.cli import CliError, Parser, add_kernel_flags, check_new_tokens_fit, check_output_folder, \
        check_ranges, kernel_settings, not_negative, parse_tree_spec, positive, resolve_device

    ap = Parser(prog="python -m inference.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="zoo name, HF folder, GGUF file or hub id")
    ap.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval or a JSON/JSONL file of prompts")
    ap.add_argument("--num-prompts", type=int, default=20, help="first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    ap.add_argument("-k", type=int, nargs="+", default=[4], help="draft lengths: a row per k for each proposer "
                    "(a drafter takes those it can draft)")
    ap.add_argument("--drafter", nargs="+", default=[], help="export folders (EAGLE-3, EAGLE-1, Medusa, MTP, DFlash)")
    ap.add_argument("--batch-size", type=int, default=0, help="also serve the prompts B at a time: plain and each "
                    "drafter (at its first k), speedup against plain at the same batch")
    ap.add_argument("--hf-prompts", type=int, default=None, help="transformers rows on the first N prompts only "
                    "(they run at tens of tokens/s); unset: all")
    ap.add_argument("--tree", action="append", default=[], metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="also draft EAGLE-2 trees with each EAGLE-3 drafter (greedy): depth, nodes kept per depth (and "
                         "the root's children), nodes verified per step, and optionally the children each kept node "
                         "below the root is expanded into (TOPK by default); repeat for a sweep")
    ap.add_argument("--hf-static", action="store_true", help="also time transformers' compiled static-cache generate")
    ap.add_argument("--repeats", type=int, default=1, help="time the runtime's rows this many times, every row in "
                    "turn each pass, and report each row's median pass (its passes in bench.json)")
    ap.add_argument("--accept-other-target", action="store_true",
                    help="serve the drafters with a target whose weights differ from the one they were trained against "
                         "(said on stderr); without it that is refused")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    add_kernel_flags(ap, tuning=True)
    ap.add_argument("--adaptive-verification", default=None, metavar="COSTS.json|measure",
                    help="also time each DSpark drafter with adaptive verification (the verify width chosen per step "
                         "from its confidences and a step-cost table: a JSON file, or measure it here); recorded in "
                         "bench.json")
    ap.add_argument("--out", default="bench", help="folder for bench.json and bench.png")
    args = ap.parse_args(argv)
    try:
        check_ranges(args, {"num_prompts": positive, "max_new_tokens": positive, "batch_size": not_negative,
                            "hf_prompts": positive, "repeats": positive})
        if min(args.k) < 1:
            raise CliError(f"-k: must be positive, got {min(args.k)}")
        if args.batch_size > args.num_prompts:
            raise CliError(f"--batch-size {args.batch_size} is larger than --num-prompts {args.num_prompts}")
        trees = [parse_tree_spec(spec) for spec in args.tree]
        device = resolve_device(args.device)
        kernels = kernel_settings(args, device)
        check_output_folder(args.out, "bench.json")
        check_new_tokens_fit(args.target, args.max_new_tokens)
        if args.adaptive_verification is not None and not args.drafter:
            raise CliError("--adaptive-verification: it times drafters with a confidence head (DSpark); pass --drafter")
        if args.adaptive_verification not in (None, "measure"):
            from inference.runtime.adaptive import StepCosts

            try:
                StepCosts.load(args.adaptive_verification)
            except ValueError as e:
                raise CliError(f"--adaptive-verification: {e}") from None
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = [f"--drafter: {d} is not an export folder (no config.json)" for d in args.drafter
                if not (Path(d) / "config.json").is_file()]
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    from data.sources import DataError
    from models.zoo import AssetError

    try:
        run_bench(args.target, args.dataset, args.num_prompts, args.max_new_tokens, sorted(set(args.k)), args.drafter,
                  device, Path(args.out), hf_static=args.hf_static, batch_size=args.batch_size, hf_prompts=args.hf_prompts,
                  trees=trees, repeats=args.repeats, kernels=kernels, accept_other_target=args.accept_other_target,
                  adaptive=args.adaptive_verification)
    except (ValueError, KeyError, OSError, DataError, AssetError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
