"""python -m inference.validate: does the acceptance promised in training hold when serving?

    python -m inference.validate --drafter runs/eagle3/export --dataset mt-bench [-k 7] \
        [--target T] [--temperature 0] [--tolerance 0.1] [--num-prompts N] [--tree D,K,N] [--out DIR]
        [--promise-set NAME] [--adaptive-verification COSTS.json]

Runs the runtime on real prompts with the exported drafter (mt-bench: both turns, the second
after the target's own first answer), measures per-position acceptance a_i and tau overall,
per category and per turn, and compares them with the prediction stored in the export
(`draftsmith.json`) at the served temperature and verification (the greedy promise at T = 0;
at T > 0 the sampled one, inference/walks/sampled.py; with --tree, EAGLE-2 trees of that depth,
top-k and node count served and held to the export's promise for that tree,
inference/walks/tree.py; with --promise-set, the promise on that held-out set of
eval.datasets, such as HumanEval's answered half, serving only questions that set does not hold; with
--adaptive-verification, served with that step-cost table at batch 1 and held to the adaptive promise,
inference/validate_adaptive.py). Exit 1 when
|tau_measured - tau_predicted| / tau_predicted > tolerance.

Why a gap: the served answers are replayed through the training-time predictor (same
function training uses, now on the text the runtime produced). Predicted-on-held-out vs
replayed separates a data gap (held-out text unlike served text) from a runtime gap
(replayed vs measured on the same text: export or runtime drafting differently from
training). Replaying the prompts' text too tells prompt-like from answer-like text.

Writes report.json, report.md, acceptance_per_position.png, tau_per_category.png and
accepted_lengths.png to --out.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from inference.report import Measured, Promised, ValidationReport, write_report
from inference.served import load_prompts_for, measure, replay  # noqa: F401  (load_prompts_for: tests)
from inference.walks.tree import tree_label, tree_words
from models.acceptance import Acceptance, Prediction, TreePromise, tau_at


def turn_mix(predicted_per_turn: dict, measured_per_turn: dict) -> dict | None:
    """Predicted and measured tau for first answers and follow-up turns, each side's share of
    chains in follow-ups, and the promise re-weighted to the served share (tau is 1 + the mean
    accepted length per chain, so it mixes linearly in chains). predicted_per_turn:
    {"1": {tau, num_chains}, "2+": {...}} from the export; measured_per_turn: {turn: {tau, num_chains}}."""
    first, later = predicted_per_turn.get("1"), predicted_per_turn.get("2+")
    served_first = measured_per_turn.get(1)
    served_later = [s for t, s in measured_per_turn.items() if t > 1]
    if not (first and later and served_first and served_later) or not first["num_chains"] or not later["num_chains"]:
        return None
    n_later = sum(s["num_chains"] for s in served_later)
    if not n_later:
        return None
    later_tau = sum(s["tau"] * s["num_chains"] for s in served_later) / n_later
    served_share = n_later / (n_later + served_first["num_chains"])
    # measured - promise at the served mix splits exactly into each part's share x its own gap
    carried = {"first": (1 - served_share) * (served_first["tau"] - first["tau"]),
               "follow_up": served_share * (later_tau - later["tau"])}
    return {"predicted": {"first": first["tau"], "follow_up": later["tau"]},
            "measured": {"first": served_first["tau"], "follow_up": later_tau},
            "follow_up_share": {"heldout": later["num_chains"] / (later["num_chains"] + first["num_chains"]),
                                "served": served_share},
            "promise_at_served_mix": (1 - served_share) * first["tau"] + served_share * later["tau"],
            "gap_carried": carried}


def diagnose(predicted: dict, measured: dict, replay_answers: dict, replay_prompts: dict | None,
             per_category: dict, tolerance: float, temperature: float = 0.0, turns: dict | None = None,
             budgets: tuple | None = None, export: str = "EXPORT", sampled_text: bool | None = None,
             promise_set: str | None = None, left_out: int = 0) -> list[str]:
    """Plain sentences saying where predicted and measured part, and what that points at.
    turns: `turn_mix` output, when both sides know their turns. budgets: (tokens per answer the
    promise walked, None = whole answers; tokens per answer served). sampled_text: at T > 0,
    whether the promise at T walked answers sampled at T (eval.sampled_answers). promise_set,
    left_out: the held-out set held to (--promise-set) and how many of the data set's
    questions were not served because that set holds them."""
    lines = []
    if promise_set is not None:
        lines.append(f"Promise set: held to the promise on {promise_set}; the {left_out} questions that set holds were not "
                     "served (a promise predicts for questions it did not see).")
    if temperature > 0 and predicted.get("temperature") and sampled_text is False:
        lines.append(f"Sampled text: the promise at T = {temperature:g} walked the target's greedy answers, while serving at "
                     f"T = {temperature:g} walks its samples (a small target's samples draft far worse). Sample the "
                     f"held-out answers (`python -m inference.regenerate --temperature "
                     f"{temperature:g} --heldout-only FRACTION`) and promise on them: `python -m train.promise {export} "
                     f"eval.sampled_answers={{{temperature:g}: FILE}}`.")
    if budgets is not None and budgets[0] != budgets[1]:
        walked = "whole answers" if budgets[0] is None else f"the first {budgets[0]} tokens of each answer"
        lines.append(f"Answer budget: the promise walked {walked} but answers were served up to {budgets[1]} tokens; "
                     "acceptance climbs along an answer, so promise the served budget: "
                     f"`python -m train.promise {export} eval.max_new_tokens={budgets[1]}`.")
    tp, tm, tr = predicted["tau"], measured["tau"], replay_answers["tau"]
    runtime_gap = (tm - tr) / tr if tr else 0.0
    data_gap = (tr - tp) / tp if tp else 0.0
    if temperature > 0 and not predicted.get("temperature"):
        # an export from before sampled promises (or trained without this temperature): its greedy
        # promise is a reference only; the replay is at the served temperature
        lines.append(f"Sampling: the export promises nothing at T = {temperature:g} (predicted {tp:.3f} is its greedy "
                     f"T = 0 promise; train with eval.temperatures including {temperature:g}). On the served answers "
                     f"the predictor at T = {temperature:g} gives {tr:.3f}, the runtime measured {tm:.3f} "
                     f"({runtime_gap:+.1%}).")
    elif abs(runtime_gap) > tolerance:
        lines.append(f"Runtime gap: on the very text it served, training's predictor gives tau {tr:.3f} but the runtime "
                     f"measured {tm:.3f} ({runtime_gap:+.1%}). The drafter drafts differently when served: check the "
                     "export (norm flags, layer ids, draft vocabulary) with `python -m export.check`.")
    else:
        lines.append(f"No runtime gap: the runtime measured {tm:.3f} where training's predictor gives {tr:.3f} on the same "
                     f"answers ({runtime_gap:+.1%}); the export drafts as it was trained.")
    if abs(data_gap) > tolerance:
        lines.append(f"Data gap: the promise ({tp:.3f}) was measured on held-out text unlike the served answers "
                     f"(replayed {tr:.3f}, {data_gap:+.1%}). Train and predict on the target's own answers "
                     "(`python -m inference.regenerate`), or validate on data like the held-out set.")
    diffs = [(i + 1, m - p) for i, (p, m) in enumerate(zip(predicted["a"], measured["a"]))]
    off = [f"a_{i} {d:+.3f}" for i, d in diffs if abs(d) > tolerance * max(predicted["a"][i - 1], 1e-9)]
    if off:
        lines.append("Positions off by more than the tolerance: " + ", ".join(off) + ".")
    worst = sorted(per_category.items(), key=lambda kv: kv[1]["tau"])
    if len(worst) > 1:
        lines.append("Lowest categories: " + ", ".join(f"{c} {s['tau']:.3f}" for c, s in worst[:3]) +
                     "; highest: " + ", ".join(f"{c} {s['tau']:.3f}" for c, s in worst[-2:]) + ".")
    if turns is not None:
        p, m, share = turns["predicted"], turns["measured"], turns["follow_up_share"]
        mixed = turns["promise_at_served_mix"]
        lines.append(f"Turns: first answers predicted {p['first']:.3f}, measured {m['first']:.3f} "
                     f"({m['first'] / p['first'] - 1:+.1%}); follow-up turns predicted {p['follow_up']:.3f}, measured "
                     f"{m['follow_up']:.3f} ({m['follow_up'] / p['follow_up'] - 1:+.1%}). Follow-ups are "
                     f"{share['served']:.0%} of the served chains against {share['heldout']:.0%} of the held-out ones; "
                     f"weighted as served, the promise would be {mixed:.3f} ({tm / mixed - 1:+.1%} against measured).")
        carried = turns.get("gap_carried")
        if carried:
            part = max(carried, key=lambda name: abs(carried[name]))
            lines.append(f"The gap against that weighted promise is carried mostly by "
                         f"{'first answers' if part == 'first' else 'follow-up turns'}: first answers contribute "
                         f"{carried['first']:+.3f} tau, follow-ups {carried['follow_up']:+.3f}.")
    if replay_prompts is not None:
        lines.append(f"Text kind: drafting over the prompts' text replays at tau {replay_prompts['tau']:.3f}, over the "
                     f"answers at {tr:.3f}.")
    return lines


def validate(drafter_dir: str, dataset: str, target: str | None = None, k: int | None = None,
             temperature: float = 0.0, tolerance: float = 0.1, num_prompts: int | None = None,
             max_new_tokens: int = 256, out: str = "validation", device: str | None = None,
             anchors: int = 64, max_turns: int | None = None, progress: bool = True, verification: str = "standard",
             references_to_run: tuple[str, ...] = (), max_minutes: float | None = None,
             batch_size: int | None = None, tree: tuple[int, ...] | None = None,
             promise_set: str | None = None, kernels=None, accept_other_target: bool = False,
             adaptive_costs: str | None = None) -> dict:
    """Serve, measure, replay and compare (the module's docstring). tree (depth, top_k,
    total_tokens[, children]): serve EAGLE-2 trees instead of chains (k = depth), held to the export's tree
    promise (`trees` in its predicted acceptance, inference/walks/tree.py). promise_set: the
    held-out set (of eval.datasets) whose promise the served acceptance is held to, instead of
    the first; the questions that set holds are left out of serving. kernels: the runtime's
    kernel settings (kernels/settings.py KernelSettings; default: the defaults), in report.json.
    adaptive_costs: a step-cost table to serve with adaptive verification, held to the adaptive
    promise (inference/validate_adaptive.py; batch 1)."""
    import time

    import torch
    from transformers import AutoTokenizer

    from data.templates import trained_template
    from export.load import load_export
    from inference.runtime.fallback import load_runtime
    from models.target import Target
    from models.zoo import resolve_target

    folder = Path(drafter_dir)
    adaptive = costs = None
    if adaptive_costs is not None:
        from inference import validate_adaptive

        costs = validate_adaptive.check_request(adaptive_costs, tree, batch_size)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--drafter: {folder} is not an export folder (no config.json)")
    prov_path = folder / "draftsmith.json"
    from export.io import read_json

    provenance = read_json(prov_path) if prov_path.is_file() else {}
    raw = provenance.get("predicted_acceptance")
    predicted = Prediction.from_dict(raw, f"{prov_path}: predicted_acceptance") if raw else None
    walked = frozenset()
    if promise_set is not None:
        if predicted is None:
            raise ValueError(f"--promise-set {promise_set}: {folder} carries no promise (no draftsmith.json)")
        from inference.served import first_questions

        predicted = predicted.for_set(promise_set)
        if temperature > 0 and tree is None and costs is None and predicted.promise_at(temperature, verification) is None:
            raise ValueError(f"--promise-set {promise_set}: no promise at T = {temperature:g} ({verification}) on that set "
                             "(with eval.sampled_answers only the first set is walked at T > 0)")
        walked = first_questions(promise_set)  # served questions must be ones the promise did not see
    if tree is not None:  # held to its own promise, found once the drafter is known to draft trees
        if temperature > 0:
            raise ValueError(f"--tree: a tree's promise is greedy for now (--temperature 0, not {temperature:g}; the runtime samples trees)")
        if k and k != tree[0]:
            raise ValueError(f"-k {k} and --tree {tree_label(tree)}: a tree's depth is its k (leave -k out)")
        k = tree[0]
    elif predicted is not None:
        k = k or predicted.k or len(predicted.greedy.a)
        if k > len(predicted.greedy.a):
            raise ValueError(f"-k {k}: the export predicts chains of at most {len(predicted.greedy.a)}")
    else:  # made elsewhere: nothing promised, so the served acceptance is held against training's
        # predictor replayed on the served answers (the runtime gap alone)
        if not k:
            raise ValueError(f"-k: {folder} carries no predicted acceptance (no draftsmith.json); pass -k")
    if costs is not None:
        adaptive = validate_adaptive.check_promise(costs, predicted, provenance, _promise_eval(provenance), k,
                                                   temperature, verification)
    target = target or provenance.get("target") or _target_named_in(read_json(folder / "config.json"))
    if not target:
        raise ValueError("--target: the export does not name its target; pass --target")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    drafter = load_export(folder, dtype=dtype).to(device)
    if adaptive is not None:
        validate_adaptive.check_drafter(drafter)
    tree_promised = make_tree = None
    if tree is not None:
        from inference.walks.tree import tree_promise
        from models.methods import check_tree_drafter

        check_tree_drafter(drafter)
        tree_promised = tree_promise(predicted, tree)
    path = resolve_target(target)
    from export.load import check_target

    other_target = check_target(folder, path, accept_other_target)  # a line for the report, when accepted
    if other_target:
        print(f"note: {other_target}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trained_template(tokenizer, [folder], target)  # a base model's template, as in training
    rt = load_runtime(path, dtype=dtype, device=device, kernels=kernels)
    if tree is not None:
        from inference.walks.tree import tree_proposers

        make_tree = tree_proposers(drafter, tree, rt.config)
    not_served = []
    questions = load_prompts_for(dataset, provenance, num_prompts, leave_out=walked, left_out=not_served)
    left_out = len(not_served)

    planned = len(questions)
    batch_size = batch_size or (16 if device == "cuda" and adaptive is None else 1)  # adaptive: batch 1's promise
    deadline = time.time() + 60 * max_minutes if max_minutes else None
    records = measure(rt, tokenizer, drafter, questions, k, max_new_tokens, temperature, max_turns=max_turns,
                      progress=progress, verification=verification, deadline=deadline, batch_size=batch_size,
                      make_proposer=make_tree, verify_tokens=tree[2] if tree else None,
                      adaptive=adaptive.runtime if adaptive else None)
    served = {r["id"] for r in records}
    questions = [q for q in questions if q["id"] in served]  # served before the deadline
    total = torch.zeros(k + 1, dtype=torch.long)
    by_cat, by_turn = defaultdict(lambda: torch.zeros(k + 1, dtype=torch.long)), defaultdict(lambda: torch.zeros(k + 1, dtype=torch.long))
    for r in records:
        h = torch.as_tensor(r["histogram"])
        total += h
        by_cat[r["category"]] += h
        by_turn[r["turn"]] += h
    sampled = temperature != 0  # sampled walks carry tau's standard error
    measured = Measured(Acceptance.from_histogram(total, with_error=sampled), _tokens_per_s(records))
    references = {}
    for name in references_to_run:
        from inference.proposers import NgramProposer, SuffixProposer

        if name == "ngram":
            make = lambda prompts, max_len: NgramProposer(k)  # noqa: E731
        else:
            suffix = SuffixProposer(k)  # one per run: its global cache of earlier answers grows question by question
            make = lambda prompts, max_len: suffix  # noqa: E731
        ref = measure(rt, tokenizer, None, questions, k, max_new_tokens, temperature, max_turns=max_turns,
                      progress=progress, verification=verification, make_proposer=make, batch_size=batch_size)
        hist = sum((torch.as_tensor(r["histogram"]) for r in ref), torch.zeros(k + 1, dtype=torch.long))
        references[name] = Measured(Acceptance.from_histogram(hist), _tokens_per_s(ref))

    rt_kernels = rt.kernels.record()
    del rt
    tgt = Target.load(target, drafter.aux_layer_ids, dtype=dtype, device=device)
    # every served chain: the walk then is the runtime's own (adaptive: verifying the width it chose)
    width = adaptive.widths(k, device) if adaptive else None
    replay_answers = Acceptance.from_histogram(replay(tgt, drafter, records, k, None, "answer", temperature, verification,
                                                      tree=tree, verify_width=width), with_error=sampled)
    replay_prompts = Acceptance.from_histogram(replay(tgt, drafter, records, k, anchors, "prompt", temperature, verification,
                                                      tree=tree, verify_width=width), with_error=sampled)
    pred = promised(predicted, k, temperature, verification, replay_answers, tree_promised, adaptive is not None)
    adaptive_record = adaptive.record(records) if adaptive else None
    per_category = {c: Acceptance.from_histogram(h) for c, h in by_cat.items()}
    per_turn = {t: Acceptance.from_histogram(h) for t, h in by_turn.items()}
    turns = turn_mix(pred.per_turn or {}, {t: s.to_dict() for t, s in per_turn.items()})
    gap = (measured.acceptance.tau - pred.tau) / pred.tau
    report = ValidationReport(
        drafter=str(folder), target=target, dataset=dataset, k=k, temperature=temperature, verification=verification,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        num_questions=len(questions), questions_planned=planned, num_answers=len(records), batch_size=batch_size,
        max_new_tokens=max_new_tokens, predicted=pred, measured=measured, replay_answers=replay_answers,
        replay_prompts=replay_prompts, per_category=per_category, per_turn=per_turn, turns=turns, relative_gap=gap,
        tolerance=tolerance, passed=abs(gap) <= tolerance, references=references,
        tree=None if tree is None else {"depth": tree[0], "top_k": tree[1], "total_tokens": tree[2],
                                        **({"children": tree[3]} if len(tree) > 3 else {}),
                                        "verify_tokens_per_step": tree[2] + 1},
        diagnosis=tuple(diagnose(pred.to_dict(), measured.to_dict(), replay_answers.to_dict(), replay_prompts.to_dict(),
                                 {c: s.to_dict() for c, s in per_category.items()}, tolerance, temperature, turns,
                                 (promised_budget(provenance), max_new_tokens) if predicted is not None else None,
                                 str(folder), promised_on_samples(provenance, temperature), promise_set, left_out)
                        + ([f"Other target: {other_target}."] if other_target else [])
                        + ([validate_adaptive.diagnosis_line(adaptive, adaptive_record, k)] if adaptive else [])),
        kernels=rt_kernels, adaptive=adaptive_record)
    write_report(report, Path(out))
    return report.to_dict()


def _promise_eval(provenance: dict) -> dict:
    """The eval settings the export's promise was made with: its own (`python -m train.promise`),
    else training's."""
    settings = provenance.get("promise_config") or provenance.get("training_config") or {}
    return settings.get("eval") or {}


def promised_budget(provenance: dict) -> int | None:
    """Tokens per answer the export's promise walked (eval.max_new_tokens; None: whole answers,
    as every promise made before that setting)."""
    return _promise_eval(provenance).get("max_new_tokens")


def promised_on_samples(provenance: dict, temperature: float) -> bool | None:
    """Whether the export's promise at `temperature` walked answers sampled at it
    (eval.sampled_answers; None at T = 0)."""
    if temperature <= 0:
        return None
    return any(float(t) == float(temperature) for t in _promise_eval(provenance).get("sampled_answers") or {})


def _tokens_per_s(records: list[dict]) -> float:
    return sum(r["new_tokens"] for r in records) / max(sum(r["seconds"] for r in records), 1e-9)


def promised(predicted: Prediction | None, k: int, temperature: float, verification: str, replay_answers: Acceptance,
             tree: TreePromise | None = None, adaptive: bool = False) -> Promised:
    """What the served acceptance is held to: the tree promise when trees were served; else the
    export's promise at the served temperature and verification, cut to k (without one at
    T > 0, the greedy promise stands as a reference: exports from before sampled promises);
    else, from an export that promises nothing, training's predictor on the served answers.
    adaptive: the promise made with adaptive verification at that setting (there is one: checked
    before serving, inference/validate_adaptive.py)."""
    dataset = (predicted.dataset if predicted else None) or "training data"
    if tree is not None:
        acc = tree.acceptance
        label = f"tree {tree_words(tree.shape)}"
        return Promised(acc.a, acc.tau, acc.histogram, f"held-out {dataset}, greedy (T = 0), {label}", 0.0, "greedy",
                        per_turn=_turn_taus(acc, None))
    if predicted is None:
        return Promised(replay_answers.a[:k], replay_answers.tau, replay_answers.histogram,
                        "no promise in the export: training's predictor on the served answers")
    if adaptive:
        promise = predicted.promise_at(temperature, verification, adaptive=True)
    else:
        promise = predicted.promise_at(temperature, verification) or predicted.promise_at(0.0, verification)
    acc, at = promise.acceptance, float(promise.temperature)
    whole = k == len(acc.a)  # the histogram and tau_se are the promise's own k's
    label = f", T = {at:g}, {promise.verification} verification" if at else ", greedy (T = 0)"
    if adaptive and not at:
        label = ", greedy (T = 0), adaptive verification"
    return Promised(acc.a[:k], tau_at(acc.a, k), acc.histogram if whole else None, f"held-out {dataset}" + label,
                    at, promise.verification if at or adaptive else "greedy", acc.tau_se if whole else None,
                    _turn_taus(acc, k))


def _turn_taus(acc: Acceptance, k: int | None) -> dict | None:
    """{"1" | "2+": {"tau", "num_chains"}} of a promise measured by turn (tau cut to k when given)."""
    if not acc.per_turn:  # promises from before first answers and follow-up turns were told apart
        return None
    return {label: {"tau": tau_at(t.a, k) if k else t.tau, "num_chains": t.num_chains} for label, t in acc.per_turn.items()}


def _target_named_in(config: dict) -> str | None:
    """The target an export made elsewhere names in its own config.json, if any."""
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return verifier or config.get("base_model_name_or_path")


def _export_target(folder: str) -> str | None:
    """The target an export names (draftsmith.json, else its config.json), for the CLI's checks."""
    for name, read in (("draftsmith.json", lambda c: c.get("target")), ("config.json", _target_named_in)):
        try:
            found = read(json.loads((Path(folder) / name).read_text()))
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return None


def main(argv=None) -> int:
    """The command; the --out lock it takes is given back however it ends."""
    from export.io import release_output_locks

    try:
        return _main(argv)
    finally:
        release_output_locks()


def _main(argv=None) -> int:
    from inference.cli import CliError, Parser, add_kernel_flags, check_new_tokens_fit, check_output_folder, \
        check_ranges, kernel_settings, not_negative, parse_tree_spec, positive, resolve_device

    ap = Parser(prog="python -m inference.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="export folder (draftsmith's, or one made elsewhere in a layout it reads)")
    ap.add_argument("--dataset", required=True, help="mt-bench, humaneval, sharegpt-heldout or a JSON/JSONL file")
    ap.add_argument("--target", help="default: the target named in the export")
    ap.add_argument("-k", type=int, default=None, help="chain length (unset: the predicted one)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (what training predicts); > 0: sampled")
    ap.add_argument("--verification", default="standard", choices=["standard", "block"],
                    help="rejection sampling or block verification when --temperature > 0")
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest accepted relative tau gap")
    ap.add_argument("--num-prompts", type=int, default=None, help="questions served, taken from the categories in turn (unset: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    ap.add_argument("--max-turns", type=int, default=None, help="turns served per question (unset: all)")
    ap.add_argument("--reference", action="append", choices=["ngram", "suffix"], default=[],
                    help="also serve the same prompts with this proposer (repeatable): reference rows")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no question after this long; the report covers the questions served")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="questions served together (default 16 on a GPU, 1 on CPU); tokens/s is then throughput")
    ap.add_argument("--tree", default=None, metavar="DEPTH,TOPK,NODES[,CHILDREN]",
                    help="serve EAGLE-2 trees with the EAGLE-3 drafter (greedy) and hold them to the export's promise "
                         "for that tree (train with eval.trees); CHILDREN: what each kept node below the root is "
                         "expanded into (TOPK by default)")
    ap.add_argument("--promise-set", default=None, metavar="NAME",
                    help="hold the served acceptance to the promise on this held-out set of eval.datasets (e.g. "
                         "HumanEval's answered half, from `inference.regenerate --dataset humaneval --heldout-only "
                         "0.5`); the questions that set holds are not served (unset: the first set's promise)")
    ap.add_argument("--adaptive-verification", default=None, metavar="COSTS.json",
                    help="serve with adaptive verification priced by this step-cost table (the one the export's "
                         "adaptive promise used: eval.step_costs) and hold it to that promise; batch 1 (the promise "
                         "is each chain's own width; a larger --batch-size is refused); a DSpark drafter")
    ap.add_argument("--accept-other-target", action="store_true",
                    help="serve with a target whose weights differ from the one the drafter was trained against "
                         "(said in the report); without it that is refused")
    ap.add_argument("--device", default=None, help="auto, cpu or cuda[:N] (unset: auto)")
    add_kernel_flags(ap, tuning=True)
    ap.add_argument("--out", default="validation", help="folder for report.json, report.md and the charts")
    args = ap.parse_args(argv)
    from data.sources import DataError
    from models.zoo import AssetError

    try:
        check_ranges(args, {"k": positive, "num_prompts": positive, "max_new_tokens": positive, "max_turns": positive,
                            "max_minutes": positive, "batch_size": positive, "tolerance": not_negative,
                            "temperature": not_negative})
        tree = None if args.tree is None else parse_tree_spec(args.tree)
        args.device = resolve_device(args.device)
        kernels = kernel_settings(args, args.device)
        check_output_folder(args.out, tool="validate", keep=(args.drafter,))
        check_new_tokens_fit(args.target or _export_target(args.drafter), args.max_new_tokens)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        report = validate(args.drafter, args.dataset, args.target, args.k, args.temperature, args.tolerance,
                          args.num_prompts, args.max_new_tokens, args.out, args.device, max_turns=args.max_turns,
                          verification=args.verification, references_to_run=tuple(args.reference),
                          max_minutes=args.max_minutes, batch_size=args.batch_size, tree=tree,
                          promise_set=args.promise_set, kernels=kernels, accept_other_target=args.accept_other_target,
                          adaptive_costs=args.adaptive_verification)
    except (DataError, AssetError, ValueError, KeyError, OSError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    p, m = report["predicted"]["tau"], report["measured"]["tau"]
    if tree is not None:
        print(f"tree {tree_words(tree)} ({tree[2] + 1} verify tokens per step):")
    print(f"tau predicted {p:.3f}, measured {m:.3f} ({report['relative_gap']:+.1%}, tolerance ±{args.tolerance:.0%}): "
          f"{'PASS' if report['pass'] else 'FAIL'}; report in {args.out}/report.md")
    for line in report["diagnosis"]:
        print("  " + line)
    for name, r in report["references"].items():
        print(f"  reference {name}: tau {r['tau']:.3f}, {r['tokens_per_s']:,.1f} tokens/s on the same prompts")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
