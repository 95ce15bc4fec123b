"""The runtime and the trainer at the sizes people serve, in one call: random-weight targets of
the Llama-3.2-1B, Llama-3.1-8B and Qwen3-8B shapes (or any HF config.json), built on the device
in bf16 (nothing to carry), each phase timed against the floor of the weights it reads.

    PYTHONPATH=. python scripts/scale_profile.py [--shapes llama-3.2-1b,llama-3.1-8b,qwen3-8b]
        [--hf-config PATH ...] [--parts plain,chains,tree,train,hf] [--rate 0.75] [--budget-s 440]
        [--out DIR] [--kernels auto|off|force]

Per shape (bf16, batch 1):
- copy bandwidth: a device-to-device copy, bytes read + written / time; every floor is bytes / it;
- plain: one graphed greedy step (scripts/profile_decode.py's timing) against the floor of the
  bytes a step reads (every weight but the embedding table, of which it reads one row; with tied
  embeddings the head is that table, counted once; the KV cache's reads are left out: 67 MB at
  512 positions of an 8B, 0.4%); `x_floor_all_weights` counts the table too;
- EAGLE-3 chains k = 2, 4, 7 (a random drafter of the real size: 1 layer, the target's hidden
  size, --draft-vocab rows) at synthetic acceptance --rate: the draft phase against the floor of
  what it reads (fc once, the layer k times: the advance over the verified tokens, then k - 1
  chain steps; norm + lm_head k times; `draft_x_whole_passes`: against k + 1 passes of all three,
  the coarser count), the verify phase against the plain step, tok/s and x plain;
- a tree (--tree depth,top-k,nodes), verified against the target: draft / verify ms, verify / plain;
- train: the EAGLE-3 (TTT --ttt) and DFlash (5 layers, blocks of 8) training steps at
  B1 x --train-seq, draft vocabulary --draft-vocab: tokens/s and peak memory
  (scripts/profile_train_step.py's step);
- hf: transformers' generate with a static cache (compiled by transformers on a GPU) in tok/s,
  run after every shape's other parts (its compilation is the slowest part; --budget-s cuts it first).

Results as each part completes: printed, and written (atomically, after every part) to
DIR/scale_profile.json and DIR/scale_profile.csv, whose columns are benchmarks.csv's (log_line
left empty: the line of docs/history/benchmarks-log.md the figures are logged on). No part starts
after --budget-s seconds; the files then say which parts were cut.
"""
from __future__ import annotations

import argparse
import csv
import gc
import io
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from inference.cli import CliError, add_kernel_flags, kernel_settings
from scripts.scale_shapes import (EAGLE3_RECIPE, SHAPES, copy_bandwidth, eagle3_draft_read_bytes, hf_config_of,
                                  load_hf_config, random_eagle3, random_hf, random_runtime, target_read_bytes)

TOOL = "scripts/scale_profile.py"
COLUMNS = ["measure", "value", "unit", "gpu", "commit", "date", "command", "drafter", "log_line"]  # benchmarks.csv's
PARTS = ("plain", "chains", "tree", "train", "hf")
CHAIN_KS = (2, 4, 7)
# what transformers' compiled generate is given to start with, its compilation included (an
# estimate for an 8B shape on an H100; the other parts take seconds): it starts only with this
# much of --budget-s left, so a call's limit is not reached inside it
HF_PART_S = 90.0


_START = [time.perf_counter()]  # the run's start (main resets it): each line says when its part ended


def say(shape: str, text: str):
    print(f"[{time.perf_counter() - _START[0]:6.1f} s {shape}]{text}")


def free(device):
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def git_state() -> tuple[str, bool | None]:
    """(HEAD's short hash or "not recorded" where there is no repository, uncommitted changes to
    tracked files or None)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode or not head.stdout.strip():
            return "not recorded", None
        return head.stdout.strip(), bool(git("status", "--porcelain", "--untracked-files=no").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "not recorded", None


def significant(value, digits: int = 5) -> str:
    """`digits` significant digits, never an exponent (benchmarks.csv's spelling): 4.6712, 12777, 0.00012346."""
    value = float(value)
    if value == 0 or value != value:
        return "0" if value == 0 else "nan"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


class Recorder:
    """Rows as benchmarks.csv holds them, plus the run's JSON; both files rewritten atomically
    after every part, so a run killed at its time limit leaves what it measured."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.rows, self.shapes = out, meta, [], {}

    def add(self, shape: str, what: str, value, unit: str, drafter: str = "-"):
        if value is None:
            return
        self.rows.append({"measure": f"scale.{shape}.{what}", "value": significant(value),
                          "unit": unit, "gpu": self.meta["gpu"], "commit": self.meta["commit"], "date": self.meta["date"],
                          "command": self.meta["command"], "drafter": drafter, "log_line": ""})

    def part(self, shape: str, name: str, result: dict):
        self.shapes.setdefault(shape, {})[name] = result
        self.save()

    def save(self):
        from export.io import atomic_write_json, atomic_write_text

        atomic_write_json(self.out / "scale_profile.json", {"tool": TOOL, **self.meta, "shapes": self.shapes,
                                                            "rows": self.rows})
        text = io.StringIO()
        writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.out / "scale_profile.csv", text.getvalue())


def timed_generate(rt, prompts, max_new, proposer, max_len, verification):
    """Every prompt once to warm (kernels, graph capture), then once timed → summed stats."""
    from inference.runtime.engine import generate

    for p in prompts:
        generate(rt, [p], max_new, proposer=proposer, max_len=max_len, verification=verification)
    total = {"tokens": 0, "steps": 0, "draft_s": 0.0, "verify_s": 0.0, "seconds": 0.0}
    for p in prompts:
        _, st = generate(rt, [p], max_new, proposer=proposer, max_len=max_len, verification=verification)
        total["tokens"] += st.new_tokens
        total["steps"] += st.steps
        total["draft_s"] += st.draft_seconds
        total["verify_s"] += st.verify_seconds
        total["seconds"] += st.total_seconds
    steps = max(total["steps"], 1)
    return {**total, "tok_s": total["tokens"] / total["seconds"], "tau": total["tokens"] / steps,
            "draft_ms": 1e3 * total["draft_s"] / steps, "verify_ms": 1e3 * total["verify_s"] / steps}


def runtime_parts(shape, hf_cfg, args, rec: Recorder, kernels, within_budget):
    """Bandwidth, plain, chains and tree of one shape, each recorded as it completes."""
    from draftsmith_kernels.settings import applied
    from inference.runtime.engine import CACHE_BUCKET, GreedyDecodeStep, cache_size
    from inference.proposers import drafter_proposer
    from inference.tree.loop import EagleTreeProposer
    from scripts.profile_decode import step_ms

    dev, dtype = args.device, getattr(torch, args.dtype)
    t0 = time.perf_counter()
    rt = random_runtime(hf_cfg, dev, dtype)
    rt.kernels = kernels
    bw = copy_bandwidth(dev, args.copy_mib)
    read, every = target_read_bytes(rt)
    floor_ms = 1e3 * read / bw
    built = {"bandwidth_tb_s": bw / 1e12, "read_bytes": read, "all_weight_bytes": every, "floor_ms": floor_ms,
             "floor_all_weights_ms": 1e3 * every / bw, "build_s": time.perf_counter() - t0}
    say(shape, f" built in {built['build_s']:.1f} s: weights {every / 1e9:.2f} GB ({read / 1e9:.2f} GB read a step), "
          f"copy bandwidth {bw / 1e12:.3f} TB/s -> floor {floor_ms:.3f} ms")
    rec.add(shape, "copy_bandwidth", bw / 1e12, "TB/s")
    rec.add(shape, "weights_read_per_step", read / 1e9, "GB")
    rec.add(shape, "plain.floor_ms", floor_ms, "ms")
    rec.part(shape, "weights", built)

    cache = rt.new_cache(1, args.plain_cache)
    with applied(kernels):
        plain_step = GreedyDecodeStep(rt, cache, 1, graphed=dev.startswith("cuda"))
        warmup = min(20, args.plain_steps)
        # from the cache's middle (or as far in as every step still fits: each advances one position)
        plain_step.positions.fill_(min(args.plain_cache // 2, args.plain_cache - warmup - args.plain_steps))
        ms = step_ms(plain_step, n=args.plain_steps, warmup=warmup, device=dev)
    del plain_step, cache
    torch.manual_seed(1)
    prompts = [torch.randint(100, min(hf_cfg.vocab_size, 30000), (n,)).tolist()
               for n in torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,)).tolist()]
    tree = [int(x) for x in args.tree.split(",")]
    max_len = -(-cache_size(prompts, args.max_new, max(tree[2], max(CHAIN_KS))) // CACHE_BUCKET) * CACHE_BUCKET
    plain_gen = timed_generate(rt, prompts, args.max_new, None, max_len, "standard")
    plain = {"step_ms": ms, "x_floor": ms / floor_ms, "x_floor_all_weights": ms / built["floor_all_weights_ms"],
             "tok_s": plain_gen["tok_s"], "generate": plain_gen}
    say(shape, f" plain: step {ms:.3f} ms = {plain['x_floor']:.2f}x floor "
          f"({plain['x_floor_all_weights']:.2f}x counting the embedding), generate {plain['tok_s']:.1f} tok/s")
    rec.add(shape, "plain.step_ms", ms, "ms")
    rec.add(shape, "plain.x_floor", plain["x_floor"], "x")
    rec.add(shape, "plain.x_floor_all_weights", plain["x_floor_all_weights"], "x")
    rec.add(shape, "plain.tok_s", plain["tok_s"], "tok/s")
    rec.part(shape, "plain", plain)

    drafter = random_eagle3(hf_cfg, args.draft_vocab, dev, dtype) if {"chains", "tree"} & set(args.parts) else None
    who = f"random EAGLE-3 (1 layer, Vd {args.draft_vocab})"
    for k in CHAIN_KS if "chains" in args.parts else ():
        if not within_budget(f"{shape} EAGLE-3 k={k}"):
            break
        r = timed_generate(rt, prompts, args.max_new, drafter_proposer(drafter, k, 1, max_len, rt.config), max_len,
                           f"synthetic:{args.rate}")
        reads = eagle3_draft_read_bytes(drafter, k)
        # whole passes: k + 1 passes of fc, layer and head (issue 54's first count), beside the exact one
        whole = (k + 1) * (reads["fc_bytes"] + reads["layer_bytes"] + reads["head_bytes"])
        r.update(reads, draft_floor_ms=1e3 * reads["bytes"] / bw, whole_passes_floor_ms=1e3 * whole / bw, rate=args.rate)
        r.update(draft_x_floor=r["draft_ms"] / r["draft_floor_ms"], draft_x_whole_passes=r["draft_ms"] / r["whole_passes_floor_ms"],
                 verify_x_plain=r["verify_ms"] / ms, x_plain=r["tok_s"] / plain["tok_s"])
        say(shape, f" EAGLE-3 k={k} at {args.rate}: draft {r['draft_ms']:.3f} ms = {r['draft_x_floor']:.2f}x its floor "
              f"({r['draft_floor_ms']:.3f} ms; {r['draft_x_whole_passes']:.2f}x {k + 1} whole passes), "
              f"verify {r['verify_ms']:.3f} ms = {r['verify_x_plain']:.2f}x plain, "
              f"{r['tok_s']:.1f} tok/s = {r['x_plain']:.2f}x plain (tau {r['tau']:.2f})")
        name = f"eagle3_chain_k{k}"
        for what, unit in (("draft_ms", "ms"), ("draft_floor_ms", "ms"), ("draft_x_floor", "x"),
                           ("draft_x_whole_passes", "x"), ("verify_ms", "ms"),
                           ("verify_x_plain", "x"), ("tok_s", "tok/s"), ("x_plain", "x"), ("tau", "tokens/step")):
            rec.add(shape, f"{name}.{what}", r[what], unit, who)
        rec.part(shape, name, r)
    if "tree" in args.parts and within_budget(f"{shape} tree"):
        depth, top_k, nodes = tree
        r = timed_generate(rt, prompts, args.max_new, EagleTreeProposer(drafter, depth, top_k, nodes, 1, max_len, rt.config),
                           max_len, "standard")
        r.update(depth=depth, top_k=top_k, nodes=nodes, verify_x_plain=r["verify_ms"] / ms, x_plain=r["tok_s"] / plain["tok_s"])
        say(shape, f" tree {depth}-{top_k}-{nodes}: draft {r['draft_ms']:.3f} ms, verify {r['verify_ms']:.3f} ms = "
              f"{r['verify_x_plain']:.2f}x plain (tau {r['tau']:.2f}: a random drafter, verified by the target)")
        name = f"tree_{depth}_{top_k}_{nodes}"
        for what, unit in (("draft_ms", "ms"), ("verify_ms", "ms"), ("verify_x_plain", "x")):
            rec.add(shape, f"{name}.{what}", r[what], unit, who)
        rec.part(shape, name, r)
    del rt, drafter
    free(dev)


def train_parts(shape, hf_cfg, args, rec: Recorder, within_budget):
    """The EAGLE-3 and DFlash recipes' training steps (target forward included) at B1 x T."""
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.target import Target
    from scripts.profile_train_step import step
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    dev, vd, V = args.device, args.draft_vocab, hf_cfg.vocab_size
    cuda = dev.startswith("cuda")
    torch.manual_seed(0)
    model = random_hf(hf_cfg, dev, getattr(torch, args.dtype))
    ids_kept = torch.sort(torch.randperm(V)[:vd]).values
    d2t, t2d = ids_kept - torch.arange(vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids_kept, True)
    recipes = {"eagle3": lambda: Eagle3Drafter(Eagle3Config.from_target(hf_cfg, vd, **EAGLE3_RECIPE)),
               "dflash": lambda: DFlashDrafter(DFlashConfig.from_target(hf_cfg, vd, mask_token_id=0, num_layers=5,
                                                                         block_size=8))}
    for method, make in recipes.items():
        if not within_budget(f"{shape} train {method}"):
            break
        with torch.device(dev):  # float32 master weights, made where they train (an 8B DFlash drafter is 7 GB)
            drafter = make()
        drafter.init_from_target(model, d2t, t2d)
        module = DrafterModule(Target(model, drafter.aux_layer_ids), drafter, ObjectiveConfig(ttt_steps=args.ttt),
                               OptimConfig(), EvalConfig(), 1000).to(dev)
        opt = torch.optim.AdamW([p for p in module.drafter.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
        ids = torch.randint(0, V, (1, args.train_seq), device=dev)
        mask = torch.ones_like(ids)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timings: dict = {}
        for _ in range(args.train_steps):
            step(module, opt, ids, mask, timings, autocast=cuda)
        keep = max(1, args.train_steps - 2)  # the first steps compile and allocate
        med = {k: statistics.median(v[-keep:]) for k, v in timings.items()}
        r = {"tokens_s": args.train_seq / (med["total"] / 1e3), "ms": med, "steps": args.train_steps,
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
             "batch": 1, "seq": args.train_seq, "draft_vocab": vd, "ttt": module.steps}
        say(shape, f" train {method}: {r['tokens_s']:,.0f} tokens/s, "
              + (f"peak {r['peak_gib']:.1f} GiB, " if cuda else "")
              + " ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
        who = f"random {method} recipe (B1 x {args.train_seq}, TTT {module.steps}, Vd {vd})"
        rec.add(shape, f"train_{method}.tokens_s", r["tokens_s"], "tokens/s", who)
        rec.add(shape, f"train_{method}.peak_gib", r["peak_gib"], "GiB", who)
        rec.part(shape, f"train_{method}", r)
        del module, opt, drafter, ids, mask
        free(dev)
    del model
    free(dev)


def hf_part(shape, hf_cfg, args, rec: Recorder):
    """transformers' generate with a static cache, which transformers compiles on a GPU: one
    warm generation of the same length (compilation, graph capture), then the timed ones."""
    if not args.device.startswith("cuda"):
        say(shape, " hf: skipped (transformers compiles its static-cache forward only on a GPU)")
        rec.part(shape, "hf_static_compiled", {"skipped": "needs CUDA"})
        return
    model = None
    try:
        torch.manual_seed(0)
        model = random_hf(hf_cfg, args.device, getattr(torch, args.dtype))
        ids = torch.randint(100, min(hf_cfg.vocab_size, 30000), (1, args.prompt_len), device=args.device)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.hf_new, min_new_tokens=args.hf_new,
                  do_sample=False, cache_implementation="static", pad_token_id=0)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        r = {"tok_s": (out.shape[1] - ids.shape[1]) / seconds, "new_tokens": out.shape[1] - ids.shape[1],
             "warm_s": warm}
        say(shape, f" transformers static cache (compiled): {r['tok_s']:.1f} tok/s (first call {warm:.0f} s)")
        rec.add(shape, "transformers_static_compiled.tok_s", r["tok_s"], "tok/s")
    except Exception as e:  # a compile failure is reported, the profile goes on
        r = {"skipped": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        say(shape, f" transformers static cache (compiled): {r['skipped']}")
    rec.part(shape, "hf_static_compiled", r)
    del model
    torch._dynamo.reset()
    free(args.device)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all three, or "
                    "none when --hf-config is given)")
    ap.add_argument("--hf-config", action="append", default=[], metavar="PATH",
                    help="also profile this HF config.json (or a folder holding one); repeatable")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (the plain step "
                    "always runs with chains or tree: their ratios' base)")
    ap.add_argument("--rate", type=float, default=0.75, help="synthetic acceptance of each chain draft")
    ap.add_argument("--tree", default="6,10,60", metavar="DEPTH,TOPK,NODES")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per generation row")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt lengths are drawn from half of this to it")
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--plain-steps", type=int, default=200, help="timed graphed plain steps")
    ap.add_argument("--plain-cache", type=int, default=1024, help="KV cache of the plain step (timed at its middle)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth copy")
    ap.add_argument("--train-seq", type=int, default=2048)
    ap.add_argument("--train-steps", type=int, default=5, help="training steps; the median of all but the first two")
    ap.add_argument("--ttt", type=int, default=7, help="EAGLE-3's TTT unroll (DFlash drafts blocks of 8: 7)")
    ap.add_argument("--hf-new", type=int, default=128, help="tokens of each transformers generation")
    ap.add_argument("--budget-s", type=float, default=440.0, help="no part starts after this many seconds (the "
                    f"compiled generate not after this less {HF_PART_S:.0f})")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--out", default="scale-profile")
    add_kernel_flags(ap, tuning=True)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad or not args.parts:
        raise CliError(f"--parts: {', '.join(bad) or '(none)'} not among {', '.join(PARTS)}")
    names = [s for s in (args.shapes or "").split(",") if s] if args.shapes is not None or args.hf_config else list(SHAPES)
    bad = [s for s in names if s not in SHAPES]
    if bad:
        raise CliError(f"--shapes: {', '.join(bad)} not among {', '.join(SHAPES)} (others: --hf-config PATH)")
    try:
        tree = [int(x) for x in args.tree.split(",")]
        assert len(tree) == 3 and min(tree) >= 1
    except (ValueError, AssertionError):
        raise CliError(f"--tree {args.tree!r}: DEPTH,TOPK,NODES, three positive integers") from None
    if not 0.0 <= args.rate <= 1.0:
        raise CliError(f"--rate {args.rate}: a probability in 0..1")
    if min(args.draft_vocab, args.prompts, args.prompt_len, args.max_new, args.plain_steps, args.copy_mib,
           args.train_seq, args.ttt, args.hf_new) < 1 or args.train_steps < 1:
        raise CliError("the sizes and counts must be positive")
    if args.plain_cache < min(20, args.plain_steps) + args.plain_steps:
        raise CliError(f"--plain-cache {args.plain_cache}: the timed steps and their warm-up need a position each "
                       f"({min(20, args.plain_steps) + args.plain_steps})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device here (--device cpu rehearses the parts a CPU can run)")
    shapes = {n: hf_config_of(SHAPES[n]) for n in names}
    for path in args.hf_config:
        try:
            cfg = load_hf_config(path)
        except ValueError as e:
            raise CliError(str(e)) from None
        p = Path(path).resolve()
        shapes[(p.parent.name if p.name == "config.json" else p.stem if p.is_file() else p.name) or "hf-config"] = cfg
    if any(args.draft_vocab > c.vocab_size for c in shapes.values()):
        raise CliError(f"--draft-vocab {args.draft_vocab} exceeds a target's vocabulary")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    old = out / "scale_profile.json"
    if old.exists():
        try:
            ours = json.loads(old.read_text()).get("tool") == TOOL
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise CliError(f"--out {out}: its scale_profile.json was not written by {TOOL}; not replacing it")
    return args, shapes, kernel_settings(args, args.device)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, shapes, kernels = parse(argv)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    start = _START[0] = time.perf_counter()
    cuda = args.device.startswith("cuda")
    commit, dirty = git_state()
    meta = {"gpu": torch.cuda.get_device_name() if cuda else args.device,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit, "uncommitted_changes": dirty,
            "command": "PYTHONPATH=. python scripts/scale_profile.py " + shlex.join(argv),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out",)} | kernels.record(),
            "cut": []}
    rec = Recorder(Path(args.out), meta)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rec.save()

    def within_budget(what: str, needs_s: float = 0.0) -> bool:
        if time.perf_counter() - start + needs_s <= args.budget_s:
            return True
        needs = f" + {needs_s:.0f} s it is given" if needs_s else ""
        print(f"-- budget: {what} not started ({time.perf_counter() - start:.0f} s{needs} > --budget-s {args.budget_s:g})")
        meta["cut"].append(what)
        rec.save()
        return False

    for shape, cfg in shapes.items():
        if {"plain", "chains", "tree"} & set(args.parts) and within_budget(f"{shape} runtime"):
            runtime_parts(shape, cfg, args, rec, kernels, within_budget)
        if "train" in args.parts and within_budget(f"{shape} train"):
            train_parts(shape, cfg, args, rec, within_budget)
    for shape, cfg in shapes.items() if "hf" in args.parts else ():
        if within_budget(f"{shape} hf", HF_PART_S):
            hf_part(shape, cfg, args, rec)
    meta["seconds"] = round(time.perf_counter() - start, 1)
    rec.save()
    print(summary(rec.shapes, meta))
    print(f"({meta['seconds']:.0f} s; {len(rec.rows)} rows in {Path(args.out) / 'scale_profile.csv'}; cut: "
          f"{', '.join(meta['cut']) or 'nothing'})")


def summary(shapes: dict, meta: dict) -> str:
    """One block per shape, each figure with its ratio (the CSV holds them all)."""
    lines = [f"\n{meta['gpu']}, {meta['date']}, commit {meta['commit']}"]
    for shape, parts in shapes.items():
        lines.append(f"{shape}:")
        if "plain" in parts:
            w, pl = parts["weights"], parts["plain"]
            lines.append(f"  plain step {pl['step_ms']:.3f} ms = {pl['x_floor']:.2f}x floor {w['floor_ms']:.3f} ms "
                         f"({w['read_bytes'] / 1e9:.2f} GB at {w['bandwidth_tb_s']:.2f} TB/s); {pl['tok_s']:.1f} tok/s")
        for name, r in parts.items():
            if name.startswith("eagle3_chain_k"):
                lines.append(f"  EAGLE-3 k={name[14:]}: draft {r['draft_ms']:.3f} ms = {r['draft_x_floor']:.2f}x floor "
                             f"({r['draft_x_whole_passes']:.2f}x whole passes), verify {r['verify_ms']:.3f} ms = "
                             f"{r['verify_x_plain']:.2f}x plain, {r['tok_s']:.1f} tok/s = {r['x_plain']:.2f}x plain")
            elif name.startswith("tree_"):
                lines.append(f"  tree {name[5:].replace('_', '-')}: draft {r['draft_ms']:.3f} ms, verify {r['verify_ms']:.3f} ms "
                             f"= {r['verify_x_plain']:.2f}x plain")
            elif name.startswith("train_"):
                peak = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
                lines.append(f"  train {name[6:]}: {r['tokens_s']:,.0f} tokens/s{peak}")
            elif name == "hf_static_compiled":
                lines.append(f"  transformers static cache (compiled): "
                             + (f"{r['tok_s']:.1f} tok/s" if "tok_s" in r else r["skipped"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
