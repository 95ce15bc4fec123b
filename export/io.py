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


_HELD: dict[str, int] = {}  # lock path -> open descriptor, for the locks this process holds


def _lock_path(dest: str | Path) -> Path:
    """Where the lock of output folder `dest` lives: in draftsmith's cache, named by the folder's
    real absolute path, so that nothing is created beside (or above) a folder not yet written."""
    from models.zoo import cache_dir

    real = os.path.realpath(os.path.abspath(dest))
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{hashlib.sha256(real.encode('utf-8', 'surrogateescape')).hexdigest()[:32]}.lock"


def output_lock(dest: str | Path, flag: str = "--out") -> bool:
    """Take the lock of an output folder for as long as this process holds it (an flock, given
    back by the OS when the process ends, however it ends): a second command writing the same
    folder is refused in one line naming the holder's pid. Taking it again in the same process
    is a no-op. Returns whether this call took it (then release_output_lock gives it back)."""
    import fcntl

    from export.paths import OutputPathError

    lock = _lock_path(dest)
    if str(lock) in _HELD:
        return False
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputPathError(f"{flag}: {dest} is being written by another process (pid {holder}); wait for it to "
                                  "finish or choose another folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:  # (else the holder before us removed the file between our open and our lock: retry)
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[str(lock)] = fd
    return True


def locked_elsewhere(dest: str | Path) -> bool:
    """Whether another process holds `dest`'s output lock now (a training writing its run
    folder, say); the probe takes nothing."""
    import fcntl

    lock = _lock_path(dest)
    if str(lock) in _HELD or not lock.exists():
        return False
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (closing gives back the probe's shared lock)
    return False


def release_output_lock(dest: str | Path) -> None:
    _release(str(_lock_path(dest)))


def _release(lock: str) -> None:
    fd = _HELD.pop(lock, None)
    if fd is not None:
        Path(lock).unlink(missing_ok=True)  # before the unlock: a waiter that opened it sees another inode and retries
        os.close(fd)


def release_output_locks() -> None:
    """Every output lock this process holds, given back (a command's last step)."""
    for lock in list(_HELD):
        _release(lock)


def remove_stale_temporaries(dest: str | Path) -> None:
    """The hidden `.NAME.tmp-*` / `.NAME.old-*` siblings an export or report killed mid-write
    (SIGKILL, power loss) left; called with the folder's lock held, so no live writer owns one."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return
    import glob

    for kind in ("tmp", "old"):
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.{kind}-*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(dest: str | Path, tool: str = "export", keep: tuple = ()):
    """Yield a temporary folder; on success it replaces `dest`, on failure it is removed. The
    folder gets the marker of `tool` (export/paths.py) listing every file in it, and its files
    the permissions of any file written here (0644 under the usual umask). An existing `dest`
    is replaced only when it is `tool`'s own output holding nothing else (check_replaceable):
    this is the one place a folder is removed, so the check is here as well as in the commands.
    The folder's lock is held (output_lock), and stale temporaries of killed runs are removed."""
    from export.paths import OutputPathError, check_replaceable, files_under, write_marker

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    took = output_lock(dest)
    tmp = None
    try:
        remove_stale_temporaries(dest)
        if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
            raise OutputPathError(f"{dest} is an existing file; refusing to replace it (choose a new folder)")
        if dest.is_dir() and any(dest.iterdir()):
            check_replaceable(dest, tool, keep=keep)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; exports are for sharing
        yield tmp
        mode = 0o666 & ~_umask()
        for rel in files_under(tmp):
            if not (tmp / rel).is_symlink():
                os.chmod(tmp / rel, mode)
        write_marker(tmp, tool, files_under(tmp))
        old = None
        if dest.exists():
            if dest.is_dir() and any(dest.iterdir()):
                check_replaceable(dest, tool, keep=keep)  # again: a file may have been added while this one was built
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.replace(dest, old)
        os.replace(tmp, dest)
        tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if took:
            release_output_lock(dest)


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
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    except SafetensorError as e:  # (a full disk, say): not an OSError of its own
        raise OSError(f"{folder.name}/model.safetensors: could not be written ({str(e).splitlines()[0][:200]}); "
                      "is the disk full?") from None
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


# ---------------------------------------------------------------- the per-batch-size draft lengths
K_TABLE = "k_table"  # draftsmith.json's key: {"rows": [[first_batch, last_batch, k], ...], ...} (inference.deploy)


def check_k_table_rows(rows, where: str = K_TABLE) -> list[list[int]]:
    """[[first_batch, last_batch, k], ...] as vLLM 0.33 takes them (v1/spec_decode/dynamic/utils.py):
    inclusive batch ranges, the first from 1, ascending without overlap, k >= 0 (0: no drafting).
    ValueError naming `where` otherwise."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: expected a non-empty list of [first_batch, last_batch, k] rows")
    out, previous = [], 0
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in row)):
            raise ValueError(f"{where}: row {row!r} is not [first_batch, last_batch, k] (three integers)")
        lo, hi, k = row
        if lo <= previous or hi < lo or k < 0:
            raise ValueError(f"{where}: row {row} must start after the last row's batch ({previous}), end at or after it "
                             "starts, and draft k >= 0")
        out.append([lo, hi, k])
        previous = hi
    if out[0][0] != 1:
        raise ValueError(f"{where}: the first row must start at batch 1 (vLLM needs every batch size covered)")
    return out


def read_k_table(folder: str | Path) -> list[list[int]] | None:
    """The export's draft length per batch size (draftsmith.json `k_table`, which `python -m
    inference.deploy` writes into a copy of an export) as the runtime's k_table rows
    (inference/runtime/engine.py draft_length), the last row carried to every larger batch, as
    vLLM and SGLang read it; None when the export carries none. ValueError on a malformed one."""
    path = Path(folder) / "draftsmith.json"
    meta = read_json(path) if path.is_file() else {}
    table = meta.get(K_TABLE) if isinstance(meta, dict) else None
    if table is None:
        return None
    rows = check_k_table_rows(table.get("rows") if isinstance(table, dict) else None, f"{path}: {K_TABLE}")
    rows[-1][1] = max(rows[-1][1], 1 << 30)
    return rows
