"""Atomic folder writes: build in a temporary sibling, then rename into place.

An interrupted export leaves the previous folder intact (or nothing); readers never see a
half-written folder.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from models.checkpoint import check_tensors  # noqa: F401  (the readers' strict check, shared with checkpoints)


@contextlib.contextmanager
def atomic_folder(dest: str | Path):
    """Yield a temporary folder; on success it replaces `dest`, on failure it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; exports are for sharing
    try:
        yield tmp
        old = None
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | Path):
    """A JSON file's content; ValueError naming the file when it is not valid JSON (or not UTF-8)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_export_files(folder: Path, tensors: dict, config: dict, meta: dict, provenance: dict | None) -> None:
    """The files of every export, into the temporary folder `atomic_folder` yields:
    model.safetensors, config.json, and draftsmith.json (meta: format, method, drafter config;
    then the weights' sha256 and the run's provenance)."""
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    write_json(folder / "draftsmith.json", {**meta, "weights_sha256": digest, **(provenance or {})})


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a temporary sibling, then rename it over `path`: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def full_vocab_maps(vocab_size: int) -> dict:
    """d2t / t2d of a draft vocabulary equal to the target's (layouts omit them then)."""
    import torch

    return {"d2t": torch.zeros(vocab_size, dtype=torch.long), "t2d": torch.ones(vocab_size, dtype=torch.bool)}


def target_embedding_and_head(target: str):
    """The target's input embedding and output head, each [V, H], read from its weights (the
    head is the embedding when they are tied)."""
    from safetensors.torch import load_file

    from models.zoo import resolve_target

    state = {}
    for f in sorted(Path(resolve_target(target)).glob("*.safetensors")):
        state.update({k: v for k, v in load_file(str(f)).items() if k in ("lm_head.weight", "model.embed_tokens.weight")})
    embed = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight", embed)
    if embed is None or head is None:
        raise KeyError(f"target {target}: model.embed_tokens.weight (and lm_head.weight unless tied) not found")
    return embed, head
