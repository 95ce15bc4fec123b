"""Checkpoint files: written atomically, read as plain data only (`weights_only=True`).

A Lightning checkpoint of draftsmith holds tensors, numbers, strings, lists and dicts and
nothing else, so it loads without unpickling arbitrary objects; a `.ckpt` that needs more
(one crafted to run code, say) is refused with one line. What a checkpoint holds, and how
it is read, is models/checkpoint.py's; this module writes them.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

# read here by --resume, and by export without train (models is the floor both stand on)
from models.checkpoint import CheckpointError, load_checkpoint  # noqa: F401


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
            except RuntimeError as e:  # torch's writer reports a full disk (ENOSPC) as a RuntimeError
                raise OSError(f"{path}: the checkpoint could not be written ({_first_line(e)}); is the disk full?") from None
            finally:
                tmp.unlink(missing_ok=True)

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            return load_checkpoint(path)

    return _SafeAtomic()


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]


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
