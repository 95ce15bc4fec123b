"""Checkpoint files: written atomically, read as plain data only (`weights_only=True`).

A Lightning checkpoint of draftsmith holds tensors, numbers, strings, lists and dicts and
nothing else, so it loads without unpickling arbitrary objects; a `.ckpt` that needs more
(one crafted to run code, say) is refused with one line.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or holds more than plain data."""


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


def make_checkpoint_io():
    """Lightning CheckpointIO: writes to a temporary file and renames it into place (a killed
    write leaves the previous checkpoint whole); reads with weights_only=True."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class _SafeAtomic(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            try:
                torch.save(checkpoint, tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            return load_checkpoint(path)

    return _SafeAtomic()


_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Temporary files of checkpoint writes that were killed (their process is gone)."""
    removed = []
    if not Path(folder).is_dir():
        return removed
    for f in Path(folder).iterdir():
        m = _TEMP.match(f.name)
        if m and f.is_file() and not _alive(int(m.group(1))):
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover of an earlier process that had our id
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
