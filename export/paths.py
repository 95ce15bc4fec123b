"""Where outputs may go: never onto something a user has that is not ours to replace.

An export goes into a new (or empty) folder, or replaces a folder that is itself a draftsmith
export, and only when asked (`--force`). Anything else at the path (a file, a folder of the
user's own, a run folder) is refused, naming it, before anything loads.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that would destroy something, or cannot be written."""


def is_draftsmith_export(folder: Path) -> bool:
    """A folder draftsmith wrote as an export: its draftsmith.json names a method and format."""
    meta = Path(folder) / "draftsmith.json"
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "method" in data and "format" in data


def check_writable(path: Path, flag: str) -> None:
    """The nearest existing ancestor of `path` is a folder we can create files in (probed, not
    guessed from permission bits, which root ignores)."""
    ancestor = Path(path).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{flag}: {ancestor} is a file, not a folder, so {path} cannot be created")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".draftsmith-write-probe-")
    except OSError as e:
        raise OutputPathError(f"{flag}: cannot write in {ancestor} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def check_export_destination(dest: str | Path, force: bool = False, flag: str = "--out") -> str:
    """'new' when `dest` is free (absent or an empty folder), 'replace' when it is a draftsmith
    export and `force` is given; OutputPathError otherwise."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise OutputPathError(f"{flag}: {dest} is an existing file; refusing to replace it (choose a new folder)")
    if dest.is_dir() and any(dest.iterdir()):
        if not is_draftsmith_export(dest):
            raise OutputPathError(f"{flag}: {dest} is an existing folder that is not a draftsmith export; "
                                  "refusing to replace it (--force replaces only exports)")
        if not force:
            raise OutputPathError(f"{flag}: {dest} already holds a draftsmith export; pass --force to replace it")
        check_writable(dest.parent, flag)
        return "replace"
    check_writable(dest, flag)
    return "new"
