"""Checkpoint files that describe themselves, read as plain data only (`weights_only=True`).

A training checkpoint (any `.ckpt` a run writes: step files, last.ckpt, an interrupted run's)
holds, beside Lightning's own keys, a `draftsmith` section of plain data:

    method          a method of models/methods.py's table ("eagle3", "eagle1", "medusa", "mtp", "dflash")
    drafter_config  the drafter's config dataclass as a dict (its class follows from method)
    draft_vocab     {"d2t": LongTensor[Vd], "t2d": BoolTensor[V]}
    target          {"name": the target as the run config gave it (zoo name or path),
                     "weights_sha256": target_weights_hash() of its files at training time,
                     "config": the target's config.json as a dict}
    run_config      the resolved run config as a dict (the provenance exports record)
    predicted       the held-out acceptance measured at this step, when there is one
                    (models/acceptance.py: Prediction.to_dict)

so `drafter_from_checkpoint` rebuilds the drafter from the file alone, and the target is
needed only by layouts that copy its tensors. Everything here loads with weights_only=True:
a checkpoint that needs more (one crafted to run code, say) is refused with one line.
"""
from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import torch

from models import methods
from models.acceptance import Prediction

SECTION = "draftsmith"
VERSION = 1
REQUIRED = ("method", "drafter_config", "draft_vocab", "target", "run_config")


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, holds more than plain data, or does not
    describe (or does not hold) the drafter it should."""


def drafter_classes(method: str):
    """(config class, drafter class) of `method` (its row of models/methods.py)."""
    row = methods.method(method)
    return row.config, row.drafter


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint's dict, loaded with weights_only=True onto the CPU."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():
            raise CheckpointError(f"{path}: refusing to load it: it holds Python objects beyond tensors and plain "
                                  "data, and unpickling those could run code") from None
        raise CheckpointError(f"{path}: not a readable checkpoint ({_first_line(e)})") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {_first_line(e)})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path}: not a draftsmith training checkpoint (no state_dict)")
    return ckpt


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


def target_weights_hash(target_path: str | Path) -> str | None:
    """sha256 over the target's *.safetensors files, each by name, size and first MiB: reading
    whole multi-GB files on every export would cost minutes, and a different checkpoint of the
    same architecture differs in size or in its first tensors. None when the target has no
    safetensors files (nothing to compare)."""
    folder = Path(target_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def _plain(obj):
    """`obj` as JSON-shaped data (tuples become lists, dict keys strings), so the section
    never holds a type weights_only refuses; an object JSON cannot hold is a TypeError here,
    at save time, not a refused file later."""
    return json.loads(json.dumps(obj))


def describe(method: str, target_name: str, target_path: str | Path, hf_config, run_config: dict) -> dict:
    """The part of the section fixed for a whole run (the drafter's config, its maps and the
    predicted acceptance are added at each save, from the drafter itself)."""
    return {"version": VERSION, "method": method, "run_config": _plain(run_config),
            "target": {"name": str(target_name), "weights_sha256": target_weights_hash(target_path),
                       "config": json.loads(hf_config.to_json_string(use_diff=False))}}


def section_for_save(description: dict, drafter, predicted: Prediction | None = None) -> dict:
    """The full section for one checkpoint: the drafter's maps are its own buffers (torch.save
    stores a storage once, so they cost nothing beside the state dict's copies)."""
    section = {**description, "drafter_config": _plain(drafter.config.to_dict()),
               "draft_vocab": {"d2t": drafter.d2t, "t2d": drafter.t2d}}
    if predicted is not None:
        section["predicted"] = _plain(predicted.to_dict())
    return section


def read_description(ckpt: dict, source) -> dict:
    """The checkpoint's section; one CheckpointError naming what is missing otherwise."""
    section = ckpt.get(SECTION)
    if not isinstance(section, dict):
        raise CheckpointError(f"{source}: the checkpoint does not describe itself (no '{SECTION}' section with the method, "
                              "drafter config, target identity and draft-vocabulary maps); it was written before draftsmith "
                              "stored them: `python -m train ... --resume` in its run folder rewrites last.ckpt with them")
    missing = [k for k in REQUIRED if k not in section]
    maps = section.get("draft_vocab")
    if isinstance(maps, dict):
        missing += [f"draft_vocab.{k}" for k in ("d2t", "t2d") if not isinstance(maps.get(k), torch.Tensor)]
    target = section.get("target")
    if isinstance(target, dict):
        missing += [f"target.{k}" for k in ("name", "weights_sha256", "config") if k not in target]
    if missing:
        raise CheckpointError(f"{source}: the checkpoint's '{SECTION}' section lacks {', '.join(missing)}")
    if section["method"] not in methods.METHODS:
        raise CheckpointError(f"{source}: unknown drafter method {section['method']!r} (known: {', '.join(methods.METHODS)})")
    return section


def check_tensors(state: dict, module, source, not_stored=()) -> None:
    """Strict reading: every tensor of `module` (but `not_stored`) present in `state` with its
    shape, nothing else; an error naming the tensor otherwise."""
    shapes = {n: t.shape for n, t in module.state_dict().items() if n not in not_stored}
    missing, unexpected = set(shapes) - set(state), set(state) - set(shapes)
    if missing or unexpected:
        raise KeyError(f"{source}: missing tensors {sorted(missing)[:5]}, unexpected tensors {sorted(unexpected)[:5]}")
    for name, t in state.items():
        if t.shape != shapes[name]:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shapes[name])}")


def drafter_from_checkpoint(checkpoint: str | Path | dict, source=None):
    """(drafter, section): the drafter of a checkpoint file (or of its loaded dict), rebuilt
    from the file alone, weights loaded strictly. CheckpointError naming the missing,
    unexpected or mis-shaped tensor, or the section's missing key."""
    if not isinstance(checkpoint, dict):
        source = source or checkpoint
        checkpoint = load_checkpoint(checkpoint)
    source = source or "checkpoint"
    section = read_description(checkpoint, source)
    config_cls, drafter_cls = drafter_classes(section["method"])
    try:
        drafter = drafter_cls(config_cls.from_dict(section["drafter_config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: its {section['method']} drafter_config does not build a drafter "
                              f"({_first_line(e)})") from None
    state = {k.removeprefix("drafter."): v for k, v in checkpoint["state_dict"].items() if k.startswith("drafter.")}
    try:
        check_tensors(state, drafter, f"{source}: drafter")
    except (KeyError, ValueError) as e:
        raise CheckpointError(str(e).strip("'\"")) from None
    maps = section["draft_vocab"]
    for name in ("d2t", "t2d"):
        if not torch.equal(maps[name], state[name]):
            raise CheckpointError(f"{source}: draft_vocab.{name} of the '{SECTION}' section differs from the drafter's {name}")
    drafter.load_state_dict(state, strict=True)
    return drafter.eval(), section
