"""python -m export.check DIR [--target T] [--checkpoint CKPT]: catch an export that a server
would load silently wrong. Four levels, each reported; exit 0 only when all hold.

  (a) keys: every expected tensor present with its shape and dtype, nothing unexpected, the
      safetensors file whole (the format's strict reader, plus a dtype census);
  (b) semantics: the drafter a server builds from config.json alone (with the server's
      defaults for absent keys: vocab sizes, widths, eps, RoPE, layer ids as the server
      captures them, norm flags) equals the trained drafter's config field by field; causal
      flags, speculative token count and bias flags are what draftsmith computes; layer ids
      and shapes agree with the target (depth, hidden size, vocabulary, RoPE base). Each
      layout module states what its config.json must say (export/formats.py: served_facts,
      expected_facts), so this file holds no branch per method;
  (c) parity: the drafter built from config.json and the exported weights computes what the
      training checkpoint computes on the same inputs (float32, the checkpoint's weights
      rounded to the export's dtype; max abs diff reported, must be <= 1e-5);
  (d) nothing random or defaulted: copied tensors equal the target's (embedding, frozen
      heads), the draft vocabulary maps are consistent, no tensor is all zeros, and the flags
      a reader would otherwise default are written out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

PARITY_TOLERANCE = 1e-5


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


class Check:
    def __init__(self, level: str, name: str):
        self.level, self.name, self.problems, self.notes = level, name, [], []

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        detail = "; ".join(self.problems or self.notes)
        return f"({self.level}) {self.name}: {status}" + (f" - {detail}" if detail else "")


def _method_and_config(folder: Path):
    meta_path = folder / "draftsmith.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{folder}: no draftsmith.json (provenance and drafter config) to check against")
    from export.io import read_json

    meta = read_json(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: not a draftsmith.json (a JSON object is expected)")
    config_class = _method(meta.get("method")).config
    try:  # as draftsmith's loader reads it: an unknown key or bad value is refused, an absent key takes its default
        meta["drafter_config"] = config_class.from_dict(meta.get("drafter_config")).to_dict()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: drafter_config is not a {config_class.__name__} ({e})") from None
    return meta.get("method"), meta


def _method(method: str):
    """The method's row of models/methods.py."""
    from models.methods import METHODS

    if method not in METHODS:
        raise ValueError(f"draftsmith.json: unknown method {method!r} (known: {', '.join(METHODS)})")
    return METHODS[method]


def check_keys(folder: Path, meta: dict):
    """(a) The format's strict reader, and one floating dtype throughout."""
    from safetensors import safe_open

    from export.load import load_export

    c = Check("a", "tensors present, shaped and typed")
    weights = folder / "model.safetensors"
    try:
        with safe_open(str(weights), "pt") as f:
            dtypes = {f.get_slice(n).get_dtype() for n in f.keys() if n not in ("d2t", "t2d", "token_map")}
    except Exception as e:  # a truncated or corrupt file: safetensors' own message names it
        c.problems.append(f"{weights.name} is unreadable ({str(e).splitlines()[0]})")
        return c, None
    if len(dtypes) > 1:
        c.problems.append(f"mixed floating dtypes {sorted(dtypes)}")
    try:
        drafter = load_export(folder, dtype=torch.float32, served=True, check_hash=False)  # as a server builds it
    except (KeyError, ValueError, TypeError, FileNotFoundError) as e:
        c.problems.append(str(e).strip("'\""))
        return c, None
    from export.load import weights_hash_problem

    changed = weights_hash_problem(folder, meta)  # (the levels below still say what the change does)
    if changed:
        c.problems.append(changed)
    from export.io import read_k_table

    try:  # the per-batch draft lengths the launch lines print (inference.deploy writes them)
        read_k_table(folder)
    except ValueError as e:
        c.problems.append(str(e))
    c.notes.append(f"{sum(1 for _ in drafter.state_dict())} tensors, dtype {next(iter(dtypes), '?')}")
    return c, drafter


# fields config.json cannot state (the target's depth is checked against the target below)
NOT_SERVED = {"target_num_layers", "layer_id_convention"}


def _layout(meta: dict):
    """The export's layout module (export/formats.py): it states what its config.json must say."""
    from export.formats import layout_module

    try:
        return layout_module(meta.get("method"), meta.get("format"))
    except ValueError as e:
        raise ValueError(f"draftsmith.json: {e}") from None


def _shape_facts(config: dict) -> dict:
    """The served facts of a layout that states none of its own: the target's shape, at the top level."""
    return {key: config.get(key) for key in ("vocab_size", "hidden_size")}


def _served_facts(layout, config: dict) -> dict:
    return getattr(layout, "served_facts", _shape_facts)(config)


def _same(found, want) -> bool:
    # a flag is the boolean itself: an absent one (None) is no false one
    return found is want if isinstance(want, bool) else found == want


def served_problems(folder: Path, layout, meta: dict, config: dict) -> list[str]:
    """Every field of the drafter a server builds from config.json that differs from the trained
    one, then every fact the layout's contract expects (expected_facts) that config.json serves
    otherwise: causal flags, draft count, layer ids as written, bias flags."""
    from export.load import served_config

    trained = meta["drafter_config"]
    try:
        served = served_config(folder).to_dict()
        problems = [f"{key}: config.json serves {served[key]}, the trained drafter has {trained[key]}"
                    for key in trained if key in served and key not in NOT_SERVED and served[key] != trained[key]]
    except (KeyError, ValueError, TypeError) as e:
        problems = [f"config.json does not build a drafter: {str(e).strip(chr(39))}"]
    facts = _served_facts(layout, config)
    for name, (want, why) in _expected_facts(layout, meta).items():
        if not _same(facts.get(name), want):
            problems.append(f"{name}: config.json says {facts.get(name)}, expected {want} ({why})")
    return problems


def _expected_facts(layout, meta: dict) -> dict:
    """name -> (value, why) the layout expects of config.json for the trained drafter (none when
    it states nothing beyond the drafter config)."""
    if not hasattr(layout, "expected_facts"):
        return {}
    k = ((meta.get("training_config") or {}).get("eval") or {}).get("k")
    return layout.expected_facts(meta["method"], meta["drafter_config"], k)


def target_shape(target_config) -> dict:
    """The target's shape, as the layouts' served facts name it."""
    from models.layers import rope_config

    return {"vocab_size": target_config.vocab_size, "hidden_size": target_config.hidden_size,
            "target_num_layers": target_config.num_hidden_layers, "rope_theta": rope_config(target_config)[0]}


def check_semantics(folder: Path, meta: dict, drafter, target_config) -> Check:
    """(b) The drafter config.json serves against the trained drafter's config and the target."""
    c = Check("b", "flags and layer ids consistent with the target")
    config = json.loads((folder / "config.json").read_text())
    layout = _layout(meta)
    c.problems.extend(served_problems(folder, layout, meta, config))
    facts = _served_facts(layout, config)
    for name, want in target_shape(target_config).items():
        found = facts.get(name)
        if name not in facts or (name == "rope_theta" and found is None):
            continue  # not stated: a layout without RoPE (Medusa); an absent RoPE base is (d)'s to name
        differs = float(found) != float(want) if name == "rope_theta" else found != want
        if differs:
            c.problems.append(f"{name}: config.json says {found}, the target {want}")
    L = target_config.num_hidden_layers
    beyond = [i for i in drafter.aux_layer_ids if not 0 <= i < L]  # the served drafter's, output-of-layer ids
    if beyond:
        c.problems.append(f"layer ids {list(drafter.aux_layer_ids)}: {beyond} beyond the {L}-layer target")
    if not c.problems:
        c.notes.append(f"{meta['method']} against a {L}-layer target")
    return c


def check_parity(folder: Path, meta: dict, drafter, checkpoint: str | None) -> Check:
    """(c) The reloaded export against the training checkpoint, same inputs, float32."""
    c = Check("c", "forward parity with the training checkpoint")
    checkpoint = checkpoint or meta.get("checkpoint")
    if not checkpoint or not Path(checkpoint).is_file():
        c.problems.append(f"no training checkpoint to compare with ({checkpoint or 'none recorded'}); pass --checkpoint")
        return c
    from models.checkpoint import load_checkpoint, read_description

    loaded = load_checkpoint(checkpoint)  # weights_only; a hostile or corrupt file is an error (exit 2)
    # the reference is built from the checkpoint's own record, never from draftsmith.json (which
    # an edit could change together with config.json)
    section = read_description(loaded, checkpoint)
    if section["method"] != meta["method"]:
        c.problems.append(f"{checkpoint} holds a {section['method']} drafter, the export a {meta['method']} one: "
                          "not this export's checkpoint")
        return c
    row = _method(section["method"])
    reference = row.drafter(row.config.from_dict(section["drafter_config"]))
    trained, recorded = section["drafter_config"], meta.get("drafter_config") or {}
    changed = [key for key in trained if not _same(recorded.get(key), trained[key])]
    if changed:  # (level b holds config.json to draftsmith.json; this holds both to the checkpoint)
        c.problems.extend(f"drafter {key}: {recorded.get(key)!r} in the export, {trained[key]!r} in the checkpoint"
                          for key in changed)
        return c
    state = {k.removeprefix("drafter."): v for k, v in loaded["state_dict"].items() if k.startswith("drafter.")}
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n not in ("d2t", "t2d", "token_map")]
        export_dtype = f.get_slice(names[0]).get_dtype() if names else "F32"
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(export_dtype, torch.float32)
    # the export's tensors went through its dtype, but for those the layout does not store: the
    # reader takes them from the target at full precision
    taken_from_target = getattr(_layout(meta), "taken_from_target", lambda method, stored: set())
    kept = taken_from_target(meta["method"], set(names))
    state = {k: (v.to(dtype).float() if v.is_floating_point() and k not in kept else v) for k, v in state.items()}
    try:
        reference.load_state_dict(state, strict=True)
    except RuntimeError as e:
        c.problems.append(f"{checkpoint}: its tensors do not fit the drafter it records ({str(e).splitlines()[0][:160]})")
        return c
    reference.eval()
    drafter.eval()
    torch.manual_seed(0)
    ids = torch.randint(0, reference.config.vocab_size, (2, 16))
    width = reference.config.hidden_size * (len(reference.aux_layer_ids) or 1)
    features = torch.randn(2, 16, width)
    steps = reference.train_steps(3)  # three unroll steps, or every head / module it has
    with torch.no_grad():
        if row.predictor == "block":  # one block per anchor
            anchors = torch.tensor([0, 5, 9])
            # a drafter with heads beside its logits (DSpark's confidence: block_outputs) is compared on all of them
            outputs = "block_outputs" if hasattr(reference, "block_outputs") else "block_logits"
            ref = [t for t in _as_list(getattr(reference, outputs)(ids[0], features[0], anchors)) if t is not None]
            got = [t for t in _as_list(getattr(drafter, outputs)(ids[0], features[0], anchors)) if t is not None]
            steps = reference.config.block_size - 1
        else:
            ref = reference.unroll(ids, features, steps, greedy=True)
            got = drafter.unroll(ids, features, steps, greedy=True)
    shapes = [(tuple(a.shape), tuple(b.shape)) for a, b in zip(ref, got) if a.shape != b.shape]
    if shapes or len(ref) != len(got):  # e.g. a block size config.json changed
        c.problems.append(f"the served drafter's outputs have other shapes than the trained one's ({shapes[:1] or len(got)})")
        return c
    diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    note = f"max abs diff {diff:.2e} over {steps} steps"
    (c.notes if diff <= PARITY_TOLERANCE else c.problems).append(note + ("" if diff <= PARITY_TOLERANCE else f" > {PARITY_TOLERANCE:g}"))
    return c


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_not_defaulted(folder: Path, meta: dict, drafter, target_path: str) -> Check:
    """(d) Copies equal the target's, maps consistent, no all-zero tensor, flags written."""
    from export.io import target_embedding_and_head

    c = Check("d", "nothing random-initialised or defaulted")
    embed, head = target_embedding_and_head(target_path)
    draft_ids = drafter.draft_ids()
    if not bool((draft_ids[1:] > draft_ids[:-1]).all()) or int(drafter.t2d.sum()) != draft_ids.numel() or not bool(drafter.t2d[draft_ids].all()):
        c.problems.append("d2t and t2d disagree (draft ids not ascending, or t2d does not mark exactly them)")
    with torch.no_grad():
        for name, t in drafter.state_dict().items():
            if t.is_floating_point() and t.numel() > 1 and not bool(t.abs().sum() > 0):
                c.problems.append(f"{name} is all zeros")
        if hasattr(drafter, "embed_tokens") and embed is not None:
            ours, theirs = drafter.embed_tokens.weight, embed.to(drafter.embed_tokens.weight.dtype)
            if ours.shape != theirs.shape or (ours - theirs.to(ours.dtype)).abs().max().item() > 1e-2 * max(1.0, theirs.abs().max().item()):
                c.problems.append("embed_tokens differs from the target's embedding (random or another target's)")
        lm_head = getattr(drafter, "lm_head", None)
        if lm_head is not None and not lm_head.weight.requires_grad and head is not None:  # a frozen copy
            rows = head[draft_ids].to(lm_head.weight.dtype)
            if (lm_head.weight - rows).abs().max().item() > 1e-2 * max(1.0, rows.abs().max().item()):
                c.problems.append("the frozen head differs from the target's head rows")
    config = json.loads((folder / "config.json").read_text())
    layout = _layout(meta)
    required = getattr(layout, "REQUIRED_KEYS", ())
    if isinstance(required, dict):  # one layout, several methods (speculators: EAGLE-3 and DFlash)
        required = required[meta["method"]]
    absent = [k for k in required if k not in config]
    facts = _served_facts(layout, config)
    if "rope_theta" in facts and facts["rope_theta"] is None:  # a layout with RoPE whose config.json leaves it out
        absent.append("rope_theta")
    if absent:
        c.problems.append(f"config.json leaves {absent} to a reader's default")
    return c


def run_checks(folder: str | Path, target: str | None = None, checkpoint: str | None = None) -> list[Check]:
    from transformers import AutoConfig

    from models.zoo import resolve_target

    folder = Path(folder)
    method, meta = _method_and_config(folder)
    keys, drafter = check_keys(folder, meta)
    checks = [keys]
    if drafter is None:  # (b) still names the served fields that disagree with the trained drafter
        semantics = Check("b", "flags and layer ids consistent with the target")
        config = json.loads((folder / "config.json").read_text())
        semantics.problems.extend(served_problems(folder, _layout(meta), meta, config)
                                  or ["not checked: the export does not load"])
        checks.append(semantics)
        for level, name in (("c", "forward parity with the training checkpoint"), ("d", "nothing random-initialised or defaulted")):
            skipped = Check(level, name)
            skipped.problems.append("not checked: the export does not load")
            checks.append(skipped)
        return checks
    target = target or meta.get("target")
    if not isinstance(target, str):
        raise ValueError(f"{folder / 'draftsmith.json'} records no target; name it with --target")
    target_path = resolve_target(target)
    target_config = AutoConfig.from_pretrained(target_path)
    checks.append(check_semantics(folder, meta, drafter, target_config))
    checks.append(check_parity(folder, meta, drafter, checkpoint))
    checks.append(check_not_defaulted(folder, meta, drafter, target_path))
    return checks


def main(argv=None) -> int:
    ap = _Parser(prog="python -m export.check", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--target", help="the target named in draftsmith.json when not given")
    ap.add_argument("--checkpoint", help="training checkpoint for the parity level (default: the one recorded)")
    args = ap.parse_args(argv)
    from models.zoo import AssetError

    if not Path(args.folder).is_dir():
        print(f"error: {args.folder} is not a folder (an export folder is expected)", file=sys.stderr)
        return 2
    if args.checkpoint is not None and not Path(args.checkpoint).is_file():
        print(f"error: --checkpoint: {args.checkpoint} does not exist", file=sys.stderr)
        return 2
    try:
        checks = run_checks(args.folder, args.target, args.checkpoint)
    except (FileNotFoundError, ValueError, KeyError, AssetError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in checks:
        print(c.line())
    ok = all(c.ok for c in checks)
    print("export OK" if ok else "export has problems")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
