"""python -m export --checkpoint RUN_OR_CKPT --format FORMAT --out DIR

Writes a trained drafter (a run folder, taking its checkpoints/last.ckpt, or a checkpoint file
inside a run folder) in a serving stack's layout, atomically. Formats per method:

    eagle3: speculators (vLLM), sglang (SGLang / EAGLE)     eagle1: eagle
    medusa: medusa (vLLM)     mtp: mtp (DeepSeek-V3; joint runs: the target with its MTP layers)
    dflash: dflash (z-lab)

A pair the format cannot carry, an option the layout cannot express, or an --out that holds
something other than a draftsmith export (a file, a folder of yours, a run folder) is one error
line and exit code 2; nothing is written. An existing export is replaced only with --force.
Checkpoints load with weights_only=True: one that holds more than tensors and plain data is
refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export.formats import FORMATS, write_export


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _run_and_checkpoint(spec: str) -> tuple[Path, Path]:
    path = Path(spec)
    if path.is_dir():
        ckpt = path / "checkpoints" / "last.ckpt"
        run_dir = path
    else:
        ckpt, run_dir = path, path.parent.parent
    if not ckpt.is_file():
        raise FileNotFoundError(f"--checkpoint: {ckpt} does not exist")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"--checkpoint: {run_dir}/config.yaml (the run's resolved config) is missing")
    return run_dir, ckpt


def export_checkpoint(spec: str, fmt: str, out: str, dtype_name: str = "bfloat16", force: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from data.templates import apply_template_choice
    from export.paths import check_export_destination
    from train.checkpoint_io import load_checkpoint

    from models.target import Target
    from models.zoo import resolve_target
    from train.config import load_config
    from train.run import _mask_token, _weights_hash, build_drafter

    run_dir, ckpt = _run_and_checkpoint(spec)
    action = check_export_destination(out, force)  # before anything loads: nothing of the user's is replaced
    cfg = load_config(str(run_dir / "config.yaml"), [])
    method = cfg.drafter.method
    if fmt not in FORMATS[method]:  # before anything loads
        raise ValueError(f"--format {fmt} cannot carry a {method} drafter (formats for {method}: {', '.join(FORMATS[method])})")
    state = load_checkpoint(ckpt)["state_dict"]
    drafter_state = {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}
    if "d2t" not in drafter_state:
        raise ValueError(f"--checkpoint: {ckpt} holds no draftsmith drafter (no drafter.d2t)")
    target_path = resolve_target(cfg.target)
    hf_config = AutoConfig.from_pretrained(target_path)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    apply_template_choice(tokenizer, cfg.data.chat_template, cfg.data.plain_text, cfg.target)  # as training set it
    drafter = build_drafter(cfg, hf_config, drafter_state["d2t"].numel(), mask_token_id=_mask_token(cfg, tokenizer))
    drafter.load_state_dict(drafter_state, strict=True)
    predicted = json.loads((run_dir / "predicted.json").read_text()).get("predicted") if (run_dir / "predicted.json").is_file() else None
    provenance = {"target": cfg.target, "target_weights_sha256": _weights_hash(target_path), "training_config": cfg.to_dict(),
                  "predicted_acceptance": predicted, "checkpoint": str(ckpt.resolve())}
    joint = any(k.startswith("target.") for k in state)
    target_model = None
    if method == "mtp" or joint:  # MTP stores the target's embedding and head; joint runs the trained target
        target_model = Target.load(cfg.target, []).model
        if joint:
            target_model.load_state_dict({k.removeprefix("target."): v for k, v in state.items() if k.startswith("target.")})
    if action == "replace":
        print(f"replacing the draftsmith export at {out} (--force)", file=sys.stderr)
    return write_export(drafter, fmt, out, method=method, target_name=cfg.target, hf_config=hf_config,
                        target_model=target_model, joint=joint, k=cfg.eval.k, provenance=provenance,
                        dtype=getattr(torch, dtype_name))


def main(argv=None) -> int:
    ap = _Parser(prog="python -m export", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a run folder (its checkpoints/last.ckpt) or a checkpoint file")
    ap.add_argument("--format", required=True, choices=sorted({f for fs in FORMATS.values() for f in fs}),
                    help="the serving layout (which ones carry which method: above)")
    ap.add_argument("--out", required=True, help="a new (or empty) folder, or an existing draftsmith export with --force")
    ap.add_argument("--force", action="store_true", help="replace --out when it is a draftsmith export (nothing else is ever replaced)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="dtype of the stored weights")
    args = ap.parse_args(argv)
    from data.sources import DataError
    from models.zoo import AssetError
    from train.config import ConfigError

    try:
        out = export_checkpoint(args.checkpoint, args.format, args.out, args.dtype, args.force)
    except (ValueError, KeyError, FileNotFoundError, ConfigError, AssetError, DataError, OSError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.format}); check it with: python -m export.check {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
