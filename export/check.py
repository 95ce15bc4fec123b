"""python -m export.check DIR [--target T] [--checkpoint CKPT]: catch an export that a server
would load silently wrong. Four levels, each reported; exit 0 only when all hold.

  (a) keys: every expected tensor present with its shape and dtype, nothing unexpected, the
      safetensors file whole (the format's strict reader, plus a dtype census);
  (b) semantics: the drafter a server builds from config.json alone (with the server's
      defaults for absent keys: vocab sizes, widths, eps, RoPE, layer ids as the server
      captures them, norm flags) equals the trained drafter's config field by field; causal
      flags, speculative token count and bias flags are what draftsmith computes; layer ids
      and shapes agree with the target (depth, hidden size, vocabulary, RoPE base);
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
        drafter = load_export(folder, dtype=torch.float32, served=True)  # as a server builds it
    except (KeyError, ValueError, FileNotFoundError) as e:
        c.problems.append(str(e).strip("'\""))
        return c, None
    c.notes.append(f"{sum(1 for _ in drafter.state_dict())} tensors, dtype {next(iter(dtypes), '?')}")
    return c, drafter


# fields config.json cannot state (the target's depth is checked against the target below)
NOT_SERVED = {"target_num_layers", "layer_id_convention"}


def served_problems(folder: Path, meta: dict, config: dict) -> list[str]:
    """Every field of the drafter a server builds from config.json that differs from the trained
    one, plus what the config module does not hold: causal flags, token count, bias flags."""
    from export.load import served_config

    trained = meta["drafter_config"]
    try:
        served = served_config(folder).to_dict()
    except (KeyError, ValueError, TypeError) as e:
        return [f"config.json does not build a drafter: {str(e).strip(chr(39))}"]
    problems = [f"{key}: config.json serves {served[key]}, the trained drafter has {trained[key]}"
                for key in trained if key in served and key not in NOT_SERVED and served[key] != trained[key]]
    method, fmt = meta["method"], meta.get("format")
    proposal = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0]
    k = ((meta.get("training_config") or {}).get("eval") or {}).get("k")
    if fmt == "speculators" and method == "dflash":
        layer = config.get("transformer_layer_config") or {}
        causal = layer["is_causal"] if layer.get("is_causal") is not None else not config.get("sliding_window_non_causal", True)
        if causal:  # vLLM 0.33 qwen3_dflash.py: is_causal first, then not sliding_window_non_causal
            problems.append("is_causal / sliding_window_non_causal: vLLM 0.33 would build the draft layers causal; "
                            "draftsmith's blocks attend bidirectionally")
        if proposal.get("speculative_tokens") != trained["block_size"] - 1:
            problems.append(f"speculative_tokens: config.json says {proposal.get('speculative_tokens')}, a block of "
                            f"{trained['block_size']} drafts {trained['block_size'] - 1} (vLLM ignores block_size)")
    elif fmt == "speculators" and k is not None and proposal.get("speculative_tokens") != k:
        problems.append(f"speculative_tokens: config.json says {proposal.get('speculative_tokens')}, trained and "
                        f"predicted for k = {k}")
    if method == "eagle1" and (config.get("bias") or config.get("attention_bias")):
        problems.append("bias / attention_bias: servers would create attention biases the file does not hold")
    if fmt == "sglang" and config.get("norm_before_residual"):
        problems.append("norm_before_residual: SGLang 0.5.23 has no such option (the residual is pre-norm)")
    return problems


def check_semantics(folder: Path, meta: dict, drafter, target_config) -> Check:
    """(b) The drafter config.json serves against the trained drafter's config and the target."""
    c = Check("b", "flags and layer ids consistent with the target")
    config = json.loads((folder / "config.json").read_text())
    cfg = meta["drafter_config"]
    method = meta["method"]
    L = target_config.num_hidden_layers
    expect = {"vocab_size": target_config.vocab_size}
    c.problems.extend(served_problems(folder, meta, config))
    if method == "eagle3" and meta.get("format") == "sglang":
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids != cfg["aux_layer_ids"] or max(ids or [L]) >= L:
            c.problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} != trained {cfg['aux_layer_ids']} (< {L})")
        if cfg["norm_before_residual"]:
            c.problems.append("a norm_before_residual drafter in the SGLang layout, which SGLang 0.5.23 cannot compute")
        expect.update(hidden_size=target_config.hidden_size)
        theta = config.get("rope_theta")
    elif method == "eagle3":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if ids != [i + 1 for i in cfg["aux_layer_ids"]]:
            c.problems.append(f"eagle_aux_hidden_state_layer_ids {ids} != output-of-layer ids {cfg['aux_layer_ids']} + 1")
        if ids and max(ids) > L:
            c.problems.append(f"aux hidden-state index {max(ids)} beyond the {L}-layer target")
        for flag in ("norm_before_residual", "norm_before_fc"):
            if config.get(flag) != cfg[flag]:
                c.problems.append(f"{flag}: config.json says {config.get(flag)}, the trained drafter {cfg[flag]}")
        for flag in ("norm_output", "fc_norm"):  # draftsmith feeds the pre-norm output on, one norm before fc at most
            if config.get(flag) is not False:
                c.problems.append(f"{flag}: config.json says {config.get(flag)}, draftsmith's EAGLE-3 computes it as false")
        layer = config.get("transformer_layer_config", {})
        expect.update(target_hidden_size=target_config.hidden_size)
        theta = layer.get("rope_theta")
    elif method == "medusa":
        for key, ours in (("num_heads", "num_heads"), ("num_hidden_layers", "num_layers"), ("truncated_vocab_size", "draft_vocab_size")):
            if config.get(key) != cfg[ours]:
                c.problems.append(f"{key}: config.json says {config.get(key)}, the trained drafter {cfg[ours]}")
        expect.update(hidden_size=target_config.hidden_size)
        theta = None
    elif method == "mtp":
        if config.get("num_nextn_predict_layers") != cfg["num_modules"]:
            c.problems.append(f"num_nextn_predict_layers {config.get('num_nextn_predict_layers')} != {cfg['num_modules']} modules")
        if config.get("num_hidden_layers") != L or cfg["target_num_layers"] != L:
            c.problems.append(f"modules stored after layer {config.get('num_hidden_layers')}, the target has {L} layers")
        expect.update(hidden_size=target_config.hidden_size)
        theta = _theta(config)
    elif method == "dflash" and meta.get("format") == "speculators":
        ids = config.get("aux_hidden_state_layer_ids")
        if ids != [i + 1 for i in cfg["target_layer_ids"]] or max(ids or [0]) > L:
            c.problems.append(f"aux_hidden_state_layer_ids {ids} != output-of-layer ids {cfg['target_layer_ids']} + 1 (<= {L})")
        for key in ("mask_token_id", "block_size", "draft_vocab_size"):
            if config.get(key) != cfg[key]:
                c.problems.append(f"{key} {config.get(key)} != trained {cfg[key]}")
        layer = config.get("transformer_layer_config") or {}
        if layer.get("num_hidden_layers") != cfg["num_layers"]:
            c.problems.append(f"transformer_layer_config.num_hidden_layers {layer.get('num_hidden_layers')} != {cfg['num_layers']} draft layers")
        if config.get("sample_from_anchor") is not False:
            c.problems.append("sample_from_anchor must be false: the anchor is the verified token, B-1 drafts")
        expect.update(hidden_size=target_config.hidden_size)
        theta = layer.get("rope_theta")
    elif method == "dflash":
        if config.get("num_target_layers") != L:
            c.problems.append(f"num_target_layers {config.get('num_target_layers')} != the target's {L}")
        d = config.get("dflash_config") or {}
        if d.get("target_layer_ids") != cfg["target_layer_ids"] or max(d.get("target_layer_ids") or [0]) >= L:
            c.problems.append(f"dflash_config.target_layer_ids {d.get('target_layer_ids')} != trained {cfg['target_layer_ids']} "
                              f"(output-of-layer ids < {L})")
        if d.get("mask_token_id") != cfg["mask_token_id"]:
            c.problems.append(f"mask_token_id {d.get('mask_token_id')} != trained {cfg['mask_token_id']}")
        if config.get("block_size") != cfg["block_size"]:
            c.problems.append(f"block_size {config.get('block_size')} != trained {cfg['block_size']}")
        expect.update(hidden_size=target_config.hidden_size)
        theta = config.get("rope_theta")
    else:  # eagle1
        expect.update(hidden_size=target_config.hidden_size)
        theta = config.get("rope_theta")
    for key, value in expect.items():
        if config.get(key, (config.get("transformer_layer_config") or {}).get(key)) != value:
            c.problems.append(f"{key}: config.json says {config.get(key)}, the target {value}")
    if theta is not None:
        from models.layers import rope_config

        target_theta, _ = rope_config(target_config)
        if float(theta) != float(target_theta):
            c.problems.append(f"rope_theta {theta} != the target's {target_theta}")
    if not c.problems:
        c.notes.append(f"{method} against a {L}-layer target")
    return c


def _theta(config: dict):
    """RoPE base of a config.json, in transformers 4 (rope_theta) or 5 (rope_parameters) form."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return params["rope_theta"]
    return config.get("rope_theta")


def check_parity(folder: Path, meta: dict, drafter, checkpoint: str | None) -> Check:
    """(c) The reloaded export against the training checkpoint, same inputs, float32."""
    c = Check("c", "forward parity with the training checkpoint")
    checkpoint = checkpoint or meta.get("checkpoint")
    if not checkpoint or not Path(checkpoint).is_file():
        c.problems.append(f"no training checkpoint to compare with ({checkpoint or 'none recorded'}); pass --checkpoint")
        return c
    row = _method(meta["method"])
    reference = row.drafter(row.config.from_dict(meta["drafter_config"]))
    from models.checkpoint import load_checkpoint

    state = load_checkpoint(checkpoint)["state_dict"]  # weights_only; a hostile or corrupt file is an error (exit 2)
    state = {k.removeprefix("drafter."): v for k, v in state.items()}
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n not in ("d2t", "t2d", "token_map")]
        export_dtype = f.get_slice(names[0]).get_dtype() if names else "F32"
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16}.get(export_dtype, torch.float32)
    # the export's tensors went through its dtype; EAGLE-1's head is not stored (the reader
    # takes the target's at full precision)
    kept = {"eagle1": {"lm_head.weight"},
            "dflash": {"embed_tokens.weight"} | ({"lm_head.weight"} - set(names))}.get(meta["method"], set())
    state = {k: (v.to(dtype).float() if v.is_floating_point() and k not in kept else v) for k, v in state.items()}
    reference.load_state_dict(state, strict=True)
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
            ref = [reference.block_logits(ids[0], features[0], anchors)]
            got = [drafter.block_logits(ids[0], features[0], anchors)]
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
        if meta["method"] in ("eagle1", "mtp", "dflash") and head is not None:
            rows = head[draft_ids].to(drafter.lm_head.weight.dtype)
            if (drafter.lm_head.weight - rows).abs().max().item() > 1e-2 * max(1.0, rows.abs().max().item()):
                c.problems.append("the frozen head differs from the target's head rows")
    config = json.loads((folder / "config.json").read_text())
    sglang = meta.get("format") == "sglang"
    required = {"eagle3": ["draft_vocab_size", "eagle_config", "rope_theta", "rms_norm_eps", "max_position_embeddings",
                           "hidden_act", "num_key_value_heads"] if sglang else
                ["norm_before_residual", "norm_before_fc", "norm_output", "fc_norm", "eagle_aux_hidden_state_layer_ids",
                 "draft_vocab_size"],
                "medusa": ["medusa_fc_bias", "truncated_vocab_size"], "eagle1": ["rope_theta"],
                "mtp": ["num_nextn_predict_layers"],
                "dflash": ["block_size", "aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size", "sample_from_anchor"]
                if meta.get("format") == "speculators" else ["block_size", "num_target_layers", "dflash_config"]}.get(meta["method"])
    if required is None:  # a method whose layout states its own (export/formats.py)
        from export.formats import layout_module

        required = list(layout_module(meta["method"], meta.get("format")).REQUIRED_KEYS)
    absent = [k for k in required if k not in config]
    if meta["method"] == "mtp" and _theta(config) is None:
        absent.append("rope_theta / rope_parameters")
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
        semantics.problems.extend(served_problems(folder, meta, json.loads((folder / "config.json").read_text()))
                                  or ["not checked: the export does not load"])
        checks.append(semantics)
        for level, name in (("c", "forward parity with the training checkpoint"), ("d", "nothing random-initialised or defaulted")):
            skipped = Check(level, name)
            skipped.problems.append("not checked: the export does not load")
            checks.append(skipped)
        return checks
    target = target or meta.get("target")
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
