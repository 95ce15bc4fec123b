"""python -m export --checkpoint RUN_OR_CKPT [--format FORMAT] [--out DIR]

Writes a trained drafter (a run folder, taking its checkpoints/last.ckpt, or any checkpoint
file, which needs nothing beside it) in a serving stack's layout, atomically. Formats per method:

    eagle3: speculators (vLLM), sglang (SGLang / EAGLE)     eagle1: eagle
    medusa: medusa (vLLM)     mtp: mtp (DeepSeek-V3; joint runs: the target with its MTP layers)
    dflash: dflash (z-lab)

A pair the format cannot carry, an option the layout cannot express, or an --out that holds
something other than a draftsmith export (a file, a folder of yours, a run folder) is one error
line and exit code 2; nothing is written. An existing export is replaced only with --force, and
only when it is one: it carries the .draftsmith-output.json export writes (export/paths.py) and
holds nothing else, the checkpoint read included. A run folder that is training now is exported
from its newest step checkpoint (its last.ckpt changes as it trains).
Checkpoints load with weights_only=True: one that holds more than tensors and plain data is
refused, and so is one that does not describe itself (written before checkpoints stored their
method, drafter config, target identity and maps). MTP and joint exports load the target the
checkpoint names and refuse it when its weights hash differs from the one recorded in training.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export.formats import FORMATS, auto_layout, launch_lines, layout_module, write_export
from models.acceptance import Prediction


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _checkpoint_file(spec: str) -> Path:
    """The checkpoint a --checkpoint names: a file, or a run folder's last.ckpt; while that run
    is training (it holds the folder's lock), last.ckpt is replaced as it goes, so its newest
    step checkpoint (written once, never replaced) is taken instead, and said."""
    import re

    from export.io import locked_elsewhere

    path = Path(spec)
    ckpt = path / "checkpoints" / "last.ckpt" if path.is_dir() else path
    if path.is_dir() and locked_elsewhere(path):
        steps = sorted(((int(m.group(1)), f) for f in (path / "checkpoints").glob("step*.ckpt")
                        if (m := re.fullmatch(r"step(\d+)\.ckpt", f.name))), key=lambda sf: sf[0])
        if not steps:
            raise FileNotFoundError(f"--checkpoint: {path} is training now and has written no step checkpoint yet "
                                    "(its last.ckpt changes as it trains); export once one is written, or when it ends")
        ckpt = steps[-1][1]
        print(f"{path} is training now: exporting its newest step checkpoint, {ckpt.name} (last.ckpt changes as it trains)",
              file=sys.stderr)
    if not ckpt.is_file():
        raise FileNotFoundError(f"--checkpoint: {ckpt} does not exist")
    return ckpt


def _predicted(section: dict, ckpt: Path, step) -> Prediction | None:
    """The held-out acceptance of exactly this checkpoint (models.acceptance.Prediction): the
    one it stored, else its run's predicted.json when that was measured at the same step (the
    file may sit alone); None when neither holds it. A stored one that lacks a key is an error
    naming it: the export would carry a promise validate cannot read."""
    if section.get("predicted") is not None:
        return Prediction.from_dict(section["predicted"], f"{ckpt}: its predicted acceptance")
    summary = ckpt.parent.parent / "predicted.json"
    if summary.is_file():
        predicted = json.loads(summary.read_text()).get("predicted")
        if isinstance(predicted, dict) and predicted.get("step") == step:
            return Prediction.from_dict(predicted, f"{summary}: predicted")
    return None


def _target_as_trained(section: dict):
    """The target the checkpoint names, loaded only when its files hash as they did in
    training: a layout that copies its tensors must not copy another model's."""
    from transformers import AutoConfig

    from models.checkpoint import CheckpointError, target_weights_hash
    from models.target import Target
    from models.zoo import resolve_target

    name, recorded = section["target"]["name"], section["target"]["weights_sha256"]
    path = resolve_target(name)
    found = target_weights_hash(path)
    if found != recorded:
        raise CheckpointError(f"target {name} ({path}): its weights hash {str(found)[:16]} is not the {str(recorded)[:16]} "
                              "the checkpoint was trained against; refusing to copy another model's tensors into the export")
    return Target.load(name, []).model, AutoConfig.from_pretrained(path)


def export_checkpoint(spec: str, fmt: str | None = None, out: str | None = None, dtype_name: str = "bfloat16",
                      force: bool = False) -> Path:
    """Export from the checkpoint file alone (models/checkpoint.py): the run folder around it
    is not read, except a predicted.json of the same step; the target is loaded (and its hash
    checked) only for MTP, whose layout stores the target's embedding and head, and for joint
    runs, whose export carries the trained target. fmt None: the method's own layout; out
    None: a folder beside the checkpoint, named after it and the layout."""
    import torch
    from transformers import AutoConfig

    from export.io import output_lock
    from export.paths import check_export_destination
    from models.checkpoint import drafter_from_checkpoint, load_checkpoint, read_description

    ckpt = _checkpoint_file(spec)
    if out is not None:  # before anything loads: nothing of the user's (the checkpoint read included) is replaced
        check_export_destination(out, force, keep=(ckpt,))
        output_lock(out)
        action = check_export_destination(out, force, keep=(ckpt,))  # again, now that no other run may change it
    checkpoint = load_checkpoint(ckpt)  # weights_only=True
    section = read_description(checkpoint, ckpt)
    method = section["method"]
    fmt = fmt or auto_layout(method, section["drafter_config"])  # EAGLE-1 without an fc bias: eagle-vllm
    layout = layout_module(method, fmt)  # refuses a layout that cannot carry the method, before the drafter is built
    if out is None:
        out = ckpt.parent / f"{ckpt.stem}-{fmt}"
        check_export_destination(out, force, keep=(ckpt,))
        output_lock(out)
        action = check_export_destination(out, force, keep=(ckpt,))  # again, now that no other run may change it
    drafter, _ = drafter_from_checkpoint(checkpoint, ckpt)
    state = checkpoint["state_dict"]
    joint = any(k.startswith("target.") for k in state)
    target_model = None
    if getattr(layout, "COPIES_TARGET", False) or joint:
        target_model, hf_config = _target_as_trained(section)
        if joint:  # the trained target replaces the one loaded
            target_model.load_state_dict({k.removeprefix("target."): v for k, v in state.items() if k.startswith("target.")})
    else:  # what the other layouts read of the target (its architectures) is in the checkpoint
        hf_config = AutoConfig.for_model(**section["target"]["config"])
    run_config = section["run_config"]
    predicted = _predicted(section, ckpt, checkpoint.get("global_step"))
    provenance = {"target": section["target"]["name"], "target_weights_sha256": section["target"]["weights_sha256"],
                  "training_config": run_config,
                  "predicted_acceptance": predicted.to_dict() if predicted else None,
                  "checkpoint": str(ckpt.resolve())}
    if action == "replace":
        print(f"replacing the draftsmith export at {out} (--force)", file=sys.stderr)
    return write_export(drafter, fmt, out, method=method, target_name=section["target"]["name"], hf_config=hf_config,
                        target_model=target_model, joint=joint, k=run_config["eval"]["k"], provenance=provenance,
                        dtype=getattr(torch, dtype_name))


def main(argv=None) -> int:
    ap = _Parser(prog="python -m export", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a run folder (its checkpoints/last.ckpt) or a checkpoint file")
    ap.add_argument("--format", choices=sorted({f for fs in FORMATS.values() for f in fs}),
                    help="the serving layout (which ones carry which method: above); default: the method's own, listed first")
    ap.add_argument("--out", help="a new (or empty) folder, or an existing draftsmith export with --force; "
                                  "default: CKPT_STEM-FORMAT beside the checkpoint file")
    ap.add_argument("--force", action="store_true", help="replace --out when it is a draftsmith export (nothing else is ever replaced)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="dtype of the stored weights")
    args = ap.parse_args(argv)
    from export.io import release_output_locks
    from models.zoo import AssetError

    try:
        out = export_checkpoint(args.checkpoint, args.format, args.out, args.dtype, args.force)
    except (ValueError, KeyError, FileNotFoundError, AssetError, OSError) as e:
        print(f"error: {str(e).strip(chr(39))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the export is built in a hidden temporary folder, removed on the way out
        print(f"interrupted: nothing was written to {args.out or 'the export folder'}", file=sys.stderr)
        return 130
    finally:
        release_output_locks()
    fmt = args.format or json.loads((Path(out) / "draftsmith.json").read_text())["format"]
    print(f"wrote {out} ({fmt}); check it with: python -m export.check {out}")
    lines = launch_lines(out)  # docs/serving.md; tests/test_launch_lines.py runs them through the servers' code
    print("serve it with:\n" + "\n".join(f"  {line}" for line in lines) if lines else
          f"served by draftsmith's runtime only: python -m inference.validate --drafter {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
