"""python -m inference.generate: a prompt (or a chat file) in, the target's answer out.

    python -m inference.generate --prompt "Explain KV caches." [--proposer ngram|suffix|drafter|none]
        [--drafter EXPORT_DIR] [-k 4] [--max-new-tokens 256] [--target smollm2-135m-instruct]
        [--chat chat.json] [--stats] [--kernels auto|off|force] [--tree DEPTH,TOPK,NODES[,CHILDREN]]

The answer is printed to stdout; with --stats, tokens/s, the draft/verify time split, the
acceptance (a_i, tau) and the kernels' mode go to stderr as JSON. Bad input is one error line and exit code 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from inference.cli import CliError, Parser, add_kernel_flags, check_fits, check_output_file, check_ranges, \
    context_window, fail as _fail, kernel_settings, not_negative, parse_tree_spec, positive, resolve_device

DRAFTER_PROPOSERS = ("drafter", "eagle3", "medusa")


def main(argv=None) -> int:
    ap = Parser(prog="python -m inference.generate", description="Greedy (speculative) generation with the runtime.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--chat", help="JSON file: a list of {role, content} messages")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="zoo name, HF folder, GGUF file or hub id")
    ap.add_argument("--proposer", default=None, choices=["none", "ngram", "ngram-gpu", "suffix", "eagle3", "medusa", "drafter", "draft-model"],
                    help="drafter / eagle3 / medusa: the trained drafter in --drafter (its kind read from the export); "
                    "unset: drafter when --drafter is given, draft-model with --draft-model, else ngram")
    ap.add_argument("--drafter", help="export folder written by draftsmith (EAGLE-3 speculators layout or Medusa layout)")
    ap.add_argument("--draft-model", help="draft-model proposer: a small LM (zoo name, HF folder or GGUF); another "
                    "vocabulary is mapped by token strings (greedy only)")
    ap.add_argument("-k", type=int, default=None, help="drafts per step (default: the export's k table at batch 1, "
                    "written by inference.deploy, else 4; with --tree, the tree's depth)")
    ap.add_argument("--tree", default=None, metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="draft EAGLE-2 trees with the EAGLE-3 drafter in --drafter (greedy; DEPTH is k), as bench and "
                         "validate do; CHILDREN: what each kept node below the root is expanded into (TOPK by default)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated at most")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this mass")
    ap.add_argument("--verification", default="standard", choices=["standard", "block"],
                    help="how drafts are verified when sampling (both keep the target's distribution)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; > 0: sampling, drafts verified by rejection sampling (same distribution)")
    ap.add_argument("--adaptive-verification", default=None, metavar="COSTS.json",
                    help="verify per step the number of drafts the drafter's confidences make fastest, priced by this "
                         "step-cost table (bench --adaptive-verification measure writes one); DSpark drafters only")
    ap.add_argument("--accept-other-target", action="store_true",
                    help="serve --drafter with a target whose weights differ from the one it was trained against "
                         "(said on stderr); without it that is refused")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--stats", action="store_true", help="print speed and acceptance to stderr as JSON")
    ap.add_argument("--prometheus", metavar="FILE", help="write the speculative-decoding counters there (text format)")
    add_kernel_flags(ap)
    args = ap.parse_args(argv)

    try:
        args.proposer = choose_proposer(args.proposer, args.drafter, args.draft_model)
        check_ranges(args, {"temperature": not_negative, "top_k": not_negative, "max_new_tokens": positive})
        tree = None if args.tree is None else parse_tree_spec(args.tree)
        device = resolve_device(args.device)
        kernels = kernel_settings(args, device)
        if args.prometheus:  # a metrics file of ours is rewritten; any other file is the user's
            check_output_file(args.prometheus, "# HELP draftsmith_spec_decode", "--prometheus")
        adaptive = None
        if args.adaptive_verification is not None:
            from inference.runtime.adaptive import AdaptiveVerification, StepCosts

            try:
                adaptive = AdaptiveVerification(StepCosts.load(args.adaptive_verification))
            except ValueError as e:
                raise CliError(f"--adaptive-verification: {e}") from None
            if tree is not None:
                raise CliError("--adaptive-verification: trees verify their nodes, not a chain's width (drop --tree)")
    except CliError as e:
        return _fail(e)
    if tree is not None:  # validate's rules (inference/validate.py): a drafter's greedy tree, its depth the k
        if args.proposer not in DRAFTER_PROPOSERS:
            return _fail(f"--tree: trees are drafted by a trained drafter (--drafter), not the {args.proposer} proposer")
        if args.temperature > 0:
            return _fail(f"--tree: trees are drafted for greedy decoding (--temperature 0, not {args.temperature:g})")
        if args.k is not None and args.k != tree[0]:
            return _fail(f"-k {args.k} and --tree {args.tree}: a tree's depth is its k (leave -k out)")
    if args.k is None and tree is None and args.drafter and (Path(args.drafter) / "config.json").is_file():
        from export.io import read_k_table
        from inference.runtime.engine import draft_length

        try:  # the export's draft length per batch size (inference.deploy), at batch 1
            table = read_k_table(args.drafter)
        except ValueError as e:
            return _fail(f"--drafter: {e}")
        args.k = None if table is None else draft_length(table, 1, 1 << 30)
        if args.k == 0:
            print("note: the export's k table turns drafting off at batch 1: plain decoding", file=sys.stderr)
            args.proposer = "none"
    args.k = (tree[0] if tree is not None else 4) if args.k is None else args.k
    if not 0 < args.top_p <= 1:
        return _fail(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.k < 1 and args.proposer != "none":
        return _fail(f"-k: must be at least 1 with a proposer, got {args.k}")
    if args.proposer in ("eagle3", "medusa", "drafter") and not args.drafter:
        return _fail(f"--drafter: the {args.proposer} proposer needs an export folder")
    if args.drafter and not (Path(args.drafter) / "config.json").is_file():
        return _fail(f"--drafter: {args.drafter} is not an export folder (no config.json)")
    if args.chat:
        try:
            messages = json.loads(Path(args.chat).read_text())
            assert isinstance(messages, list) and messages and all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
                for m in messages)
        except (OSError, ValueError, AssertionError):
            return _fail(f"--chat: {args.chat} is not a JSON list of {{role, content}} messages")
    else:
        messages = [{"role": "user", "content": args.prompt}]

    import torch
    from transformers import AutoTokenizer

    from data.chat import encode_prompt
    from data.templates import trained_template
    from inference.runtime.engine import cache_size, generate
    from inference.runtime.fallback import load_runtime
    from inference.proposers import DraftModelProposer, GpuNgramProposer, NgramProposer, SuffixProposer, drafter_proposer
    from models.zoo import AssetError, resolve_target

    from data.sources import DataError

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:  # the prompt must fit the target's context window before the model loads
        path = resolve_target(args.target)
        tokenizer = AutoTokenizer.from_pretrained(path)
        trained_template(tokenizer, [args.drafter] if args.drafter else [], args.target)  # as the drafter trained
        prompt = encode_prompt(tokenizer, messages)
        check_fits(len(prompt), args.max_new_tokens, context_window(path))
    except CliError as e:
        return _fail(e)
    except (AssetError, DataError, ValueError, KeyError, OSError) as e:
        return _fail(f"--target: {e}")
    try:
        model = load_runtime(path, dtype=dtype, device=device, kernels=kernels)
    except (AssetError, ValueError, KeyError, OSError) as e:
        return _fail(f"--target: {e}")
    k = 0 if args.proposer == "none" else args.k
    max_len = cache_size([prompt], args.max_new_tokens, k if tree is None else tree[2])  # a tree verifies its nodes
    proposer = None
    if args.proposer == "ngram":
        proposer = NgramProposer(k)
    elif args.proposer == "ngram-gpu":
        proposer = GpuNgramProposer(k, 1, max_len, device=device)
    elif args.proposer == "suffix":
        proposer = SuffixProposer(k)
    elif args.proposer == "draft-model":
        if not args.draft_model:
            return _fail("--draft-model: the draft-model proposer needs a model")
        try:
            draft_path = resolve_target(args.draft_model)
            draft = load_runtime(draft_path, dtype=dtype, device=device, kernels=kernels)
            draft_tok = AutoTokenizer.from_pretrained(draft_path)
        except (AssetError, ValueError, KeyError, OSError) as e:
            return _fail(f"--draft-model: {e}")
        same = draft_tok.get_vocab() == tokenizer.get_vocab()
        if not same and args.temperature > 0:
            return _fail("--draft-model: a draft model with another vocabulary drafts for greedy decoding only (--temperature 0)")
        proposer = DraftModelProposer(draft, k, 1, max_len, model.config, *(() if same else (tokenizer, draft_tok)))
    elif args.proposer in ("eagle3", "medusa", "drafter"):
        from export.load import load_export

        try:
            drafter = load_export(args.drafter, dtype=dtype).to(device)
            from export.load import check_target

            other_target = check_target(args.drafter, path, args.accept_other_target)
            if other_target:
                print(f"note: {other_target}", file=sys.stderr)
            if tree is None:
                proposer = drafter_proposer(drafter, k, 1, max_len, model.config)
            else:
                from inference.walks.tree import tree_proposers
                from models.methods import check_tree_drafter

                check_tree_drafter(drafter)
                proposer = tree_proposers(drafter, tree, model.config)([prompt], max_len)
        except (ValueError, KeyError, FileNotFoundError) as e:
            return _fail(f"--drafter: {e}")
    if adaptive is not None:
        from inference.proposers import capabilities

        if not capabilities(proposer).confidences:
            return _fail(f"--adaptive-verification: the {args.proposer} proposer estimates no acceptance of its drafts "
                         "(a DSpark drafter's confidence head does)")
        try:
            adaptive.costs.row(1, k)
        except ValueError as e:
            return _fail(f"--adaptive-verification: {e}")
    outputs, stats = generate(model, [prompt], args.max_new_tokens, proposer=proposer,
                              eos_ids=(tokenizer.eos_token_id,), max_len=max_len, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, verification=args.verification, adaptive=adaptive)
    print(tokenizer.decode(outputs[0], skip_special_tokens=True))
    if args.stats:
        record = adaptive.record() if adaptive is not None else {"adaptive_verification": False}
        print(json.dumps({**stats.summary(), "kernels": kernels.mode, **record}), file=sys.stderr)
    if args.prometheus:
        Path(args.prometheus).write_text(stats.prometheus())
    return 0


def choose_proposer(proposer: str | None, drafter: str | None, draft_model: str | None) -> str:
    """The proposer the flags ask for: a drafter or draft model given is the one used, and a
    --proposer that would ignore it is an error naming both."""
    if proposer is None:
        if drafter and draft_model:
            raise CliError("--drafter and --draft-model: give one (or --proposer to choose)")
        return "drafter" if drafter else "draft-model" if draft_model else "ngram"
    if drafter and proposer not in DRAFTER_PROPOSERS:
        raise CliError(f"--drafter {drafter} would be ignored by --proposer {proposer}; use --proposer drafter, or drop --drafter")
    if draft_model and proposer != "draft-model":
        raise CliError(f"--draft-model {draft_model} would be ignored by --proposer {proposer}; use --proposer draft-model, "
                       "or drop --draft-model")
    return proposer


if __name__ == "__main__":
    sys.exit(main())
