"""Where outputs may go: never onto something a user has that is not ours to replace.

A folder is draftsmith's output only when it carries draftsmith's own marker, MARKER, a JSON
file written by the command that made the folder: {"tool": "export" | "validate" | "regenerate" |
"train", "files": [what that command wrote there]}. No file name (report.json, config.yaml,
draftsmith.json) makes a folder ours. Replacing a marked folder removes only what its marker
lists, and a folder that also holds anything else (the user's notes, the command's own input) is
refused, naming it, before anything loads.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

MARKER = ".draftsmith-output.json"


class OutputPathError(ValueError):
    """An output path that would destroy something, or cannot be written."""


def read_marker(folder: str | Path) -> dict | None:
    """The folder's marker ({"tool": str, "files": [relative paths]}), or None when it has none
    (or one that is not a marker draftsmith writes)."""
    path = Path(folder) / MARKER
    if path.is_symlink() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("tool"), str) and isinstance(data.get("files"), list)
            and all(isinstance(f, str) for f in data["files"])):
        return None
    return data


def marker_text(tool: str, files) -> str:
    return json.dumps({"tool": tool, "files": sorted(files)}, indent=2) + "\n"


def write_marker(folder: str | Path, tool: str, files) -> None:
    """The marker, written atomically (a temporary sibling renamed over it)."""
    folder = Path(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{MARKER}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(marker_text(tool, files))
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / MARKER)
    finally:
        Path(tmp).unlink(missing_ok=True)


def files_under(folder: str | Path) -> list[str]:
    """Every file (and link) under `folder`, as relative POSIX paths, the marker left out."""
    folder = Path(folder)
    out = []
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = Path(root, name).relative_to(folder).as_posix()
            if rel != MARKER:
                out.append(rel)
    return sorted(out)


def foreign_files(folder: str | Path, marker: dict) -> list[str]:
    """Files under a marked folder that its marker does not list: not ours to remove."""
    listed = set(marker["files"])
    return [f for f in files_under(folder) if f not in listed]


def is_draftsmith_export(folder: Path) -> bool:
    """A folder draftsmith wrote as an export: it carries the marker of `export`."""
    marker = read_marker(folder)
    return marker is not None and marker["tool"] == "export"


def check_replaceable(dest: str | Path, tool: str, flag: str = "--out", keep: tuple = ()) -> None:
    """`dest` (an existing, non-empty folder) may be replaced whole by `tool`'s new output: it
    carries `tool`'s marker, holds nothing its marker does not list, and holds none of `keep`
    (the command's inputs). OutputPathError naming the reason otherwise."""
    dest = Path(dest)
    for path in keep:
        try:
            inside = Path(path).resolve().is_relative_to(dest.resolve())
        except OSError:
            inside = False
        if inside:
            raise OutputPathError(f"{flag}: {dest} holds {path}, this command's input; refusing to replace it "
                                  "(choose another folder)")
    marker = read_marker(dest)
    if marker is None or marker["tool"] != tool:
        what = "not" if marker is None else f"{marker['tool']}'s output, not"
        raise OutputPathError(f"{flag}: {dest} is an existing folder {what} a draftsmith {tool} output (no {MARKER} "
                              f"naming {tool}); refusing to replace it (choose a new folder)")
    extra = foreign_files(dest, marker)
    if extra:
        raise OutputPathError(f"{flag}: {dest} also holds {extra[0]}"
                              + (f" and {len(extra) - 1} more file(s)" if len(extra) > 1 else "")
                              + f" that {tool} did not write; refusing to replace it (move them out or choose a new folder)")


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


def check_export_destination(dest: str | Path, force: bool = False, flag: str = "--out", keep: tuple = ()) -> str:
    """'new' when `dest` is free (absent or an empty folder), 'replace' when it is a draftsmith
    export holding only what the export wrote (and none of `keep`, the command's inputs) and
    `force` is given; OutputPathError otherwise."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise OutputPathError(f"{flag}: {dest} is an existing file; refusing to replace it (choose a new folder)")
    if dest.is_dir() and any(dest.iterdir()):
        if not is_draftsmith_export(dest):
            raise OutputPathError(f"{flag}: {dest} is an existing folder that is not a draftsmith export; refusing to "
                                  f"replace it (it carries no {MARKER}; --force replaces only exports)")
        check_replaceable(dest, "export", flag, keep)
        if not force:
            raise OutputPathError(f"{flag}: {dest} already holds a draftsmith export; pass --force to replace it")
        check_writable(dest.parent, flag)
        return "replace"
    check_writable(dest, flag)
    return "new"
