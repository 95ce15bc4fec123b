"""Where a speculative step's time goes, before any drafter is trained: a random target shaped
like SmolLM2-135M (bf16), random drafters of the real shapes, drafts accepted at a chosen rate
(`synthetic:RATE` verification), so the step's cost is measured at a known acceptance.

    python scripts/profile_spec.py [--rate 0.75] [--prompts 6] [--max-new 256] [--out DIR]
        [--kernels auto|off|force] [--tree-attention NAME=VALUE,...]

Prints, per row: tok/s, ratio to plain (same process), tau, draft / verify / other ms per step,
host syncs per token; writes profile_spec.json to --out.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from inference.cli import CliError, add_kernel_flags, kernel_settings


def smollm2_shaped(folder: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(folder)
    return hf


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=0.75, help="probability that each draft is accepted")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trace", action="store_true", help="also profile one answer of plain, EAGLE-3 k=4, Medusa and DFlash "
                    "(torch.profiler): the top host and device ops, the engine's named ranges; traces to --out")
    ap.add_argument("--rows", default="", help="only the rows whose names contain one of these comma-separated "
                    "strings (plain always runs: the ratios' base)")
    ap.add_argument("--trace-rows", default="plain,EAGLE-3 k=4,Medusa k=4,DFlash k=7",
                    help="the rows --trace profiles (comma-separated names)")
    ap.add_argument("--tree", dest="trees", action="append", default=[], metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="add an EAGLE-2 tree row (repeatable), e.g. --tree 4,4,24; CHILDREN: what each kept node "
                         "below the root is expanded into (TOPK by default)")
    add_kernel_flags(ap, tuning=True)
    args = ap.parse_args(argv)
    try:
        kernels = kernel_settings(args, args.device)
    except CliError as error:
        raise SystemExit(f"error: {error}") from None
    from inference.runtime.engine import CACHE_BUCKET, cache_size, generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import GpuNgramProposer, drafter_proposer
    from inference.tree.loop import EagleTreeProposer
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.mtp import MTPConfig, MTPDrafter

    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    folder = Path(tempfile.mkdtemp())
    hf = smollm2_shaped(folder)
    rt = RuntimeModel.from_pretrained(folder, dtype=torch.bfloat16, device=dev)
    rt.kernels = kernels  # every generation below runs with them
    V = hf.config.vocab_size
    keep = (torch.zeros(16384, dtype=torch.long), torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.arange(16384), True))
    eagle = Eagle3Drafter(Eagle3Config.from_target(hf.config, 16384, norm_before_fc=True, norm_before_residual=True))
    eagle.init_from_target(hf.float(), *keep)
    medusa = MedusaDrafter(MedusaConfig.from_target(hf.config, 16384, num_heads=4))
    medusa.init_from_target(hf, *keep)
    # the recipes' shapes: MTP D = 3 (16k draft vocabulary), DFlash 5 layers, blocks of 8, full vocabulary
    mtp = MTPDrafter(MTPConfig.from_target(hf.config, 16384, num_modules=3))
    mtp.init_from_target(hf, *keep)
    full = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    dflash = DFlashDrafter(DFlashConfig.from_target(hf.config, V, mask_token_id=0, num_layers=5, block_size=8))
    dflash.init_from_target(hf, *full)
    eagle, medusa, mtp, dflash = (m.to(dev, torch.bfloat16).eval() for m in (eagle, medusa, mtp, dflash))
    torch.manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,)).tolist() for n in torch.randint(60, 300, (args.prompts,)).tolist()]
    room = max([8, *(int(t.split(',')[2]) for t in args.trees)])  # a tree writes its N nodes after the root
    max_len = -(-cache_size(prompts, args.max_new, room) // CACHE_BUCKET) * CACHE_BUCKET
    verification = f"synthetic:{args.rate}"
    rows = {"plain": None}
    for k in (4, 7):
        rows[f"EAGLE-3 k={k}"] = drafter_proposer(eagle, k, 1, max_len, rt.config)
        rows[f"n-gram on the device k={k}"] = GpuNgramProposer(k, 1, max_len, device=dev)
    rows["Medusa k=4"] = drafter_proposer(medusa, 4, 1, max_len, rt.config)
    rows["MTP k=3"] = drafter_proposer(mtp, 3, 1, max_len, rt.config)
    rows["DFlash k=7"] = drafter_proposer(dflash, 7, 1, max_len, rt.config)
    # EAGLE-2 trees (verified greedily whatever --rate says: a step's cost depends on its
    # shapes, not on what it accepts; graphed as chains are)
    for tree in args.trees:
        depth, top_k, total, *children = (int(x) for x in tree.split(","))
        rows[f"EAGLE-3 tree {tree.replace(',', '-')}"] = EagleTreeProposer(eagle, depth, top_k, total, 1, max_len, rt.config,
                                                                           children=children[0] if children else None)
    wanted = [w for w in args.rows.split(",") if w]
    rows = {n: p for n, p in rows.items() if n == "plain" or not wanted or any(w in n for w in wanted)}

    def verification_of(proposer):  # trees verify against the target (greedy at T = 0)
        return "standard" if getattr(proposer, "tree", False) else verification

    def run(proposer):
        total = {"tokens": 0, "steps": 0, "draft": 0.0, "verify": 0.0, "seconds": 0.0, "syncs": 0, "hist": None,
                 "setup": 0.0, "launch": 0.0, "prompts": 0}
        for p in prompts:
            outs, st = generate(rt, [p], args.max_new, proposer=proposer, max_len=max_len,
                                verification=verification_of(proposer))
            total["tokens"] += st.new_tokens
            total["steps"] += st.steps
            total["draft"] += st.draft_seconds
            total["verify"] += st.verify_seconds
            total["seconds"] += st.total_seconds
            total["syncs"] += st.host_syncs
            total["setup"] += st.setup_seconds
            total["launch"] += st.launch_seconds
            total["prompts"] += 1
            if st.k:
                total["hist"] = st.histogram if total["hist"] is None else [a + b for a, b in zip(total["hist"], st.histogram)]
        return total

    results = {}
    for name, proposer in rows.items():
        run(proposer)  # warm-up: kernels, graph capture
        sync()
        t0 = time.perf_counter()
        r = run(proposer)
        sync()
        r["wall"] = time.perf_counter() - t0
        results[name] = r
    plain = results["plain"]["tokens"] / results["plain"]["wall"]
    print(f"{'row':28s} {'tok/s':>8s} {'x plain':>8s} {'tau':>6s} {'draft':>7s} {'verify':>7s} {'other':>7s} ms/step  syncs/token")
    for name, r in results.items():
        tps = r["tokens"] / r["wall"]
        steps = max(r["steps"], 1)
        other = r["seconds"] - r["draft"] - r["verify"]
        tau = r["tokens"] / steps if r["hist"] else 1.0
        print(f"{name:28s} {tps:8.1f} {tps / plain:7.2f}x {tau:6.2f} {1e3 * r['draft'] / steps:7.3f} "
              f"{1e3 * r['verify'] / steps:7.3f} {1e3 * other / steps:7.3f}          {r['syncs'] / r['tokens']:.3f}"
              f"   (per answer: other {1e3 * other / r['prompts']:.1f} ms, setup {1e3 * r['setup'] / r['prompts']:.1f} ms;"
              f" host launches {1e3 * r['launch'] / steps:.3f} ms/step)")
        r.update(tokens_per_s=tps, vs_plain=tps / plain, tau=tau)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.trace:
        for name in (n for n in args.trace_rows.split(",") if n in rows):
            trace(rows[name], name, prompts[0], rt, args, max_len, verification_of(rows[name]))
    (Path(args.out) / "profile_spec.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if dev == "cuda" else dev, "rate": args.rate,
                                                                 **kernels.record(), "rows": results}, indent=2))


def trace(proposer, name, prompt, rt, args, max_len, verification):
    """One answer under torch.profiler: the engine's named ranges (prefill, first token, the
    proposer's begin, the loop) with their host and device time, the top ops by host time, and
    a Chrome trace (gzipped) in --out."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    from inference.runtime.engine import generate

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generate(rt, [prompt], args.max_new, proposer=proposer, max_len=max_len, verification=verification)  # warm
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        _, st = generate(rt, [prompt], args.max_new, proposer=proposer, max_len=max_len, verification=verification)
        sync()
        wall = time.perf_counter() - t0
    print(f"\n== trace: {name}: {st.new_tokens} tokens, {st.steps} steps, {1e3 * wall:.1f} ms under the profiler")
    events = prof.key_averages()
    for e in sorted((e for e in events if e.key.startswith("draftsmith.")), key=lambda e: -e.cpu_time_total):
        print(f"  {e.key:28s} host {e.cpu_time_total / 1e3:8.2f} ms  calls {e.count}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    path = Path(args.out) / f"trace-{name.replace(' ', '_').replace('=', '')}.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()


if __name__ == "__main__":
    main()
