"""The run folder (`out_dir`): what a launch may do to it.

A new or empty folder takes a new run. A folder holding a run is continued with --resume or
replaced with --overwrite, never silently. A folder holds a run only when it carries the marker
training writes first (export/paths.py: MARKER naming `train`), never because of a file name
(a Hydra project's config.yaml is not a run); a non-empty folder without it is refused, with or
without a flag. --overwrite removes only the entries a run writes, and --resume needs the stored
config of a run (its target and drafter, compared with the launch's). Nothing is written (or
removed) until training is about to start, so a launch that fails earlier leaves the folder
exactly as it was; the folder's lock is held from the check on (a second launch into it is
refused in one line).
"""
from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import yaml

from export.paths import MARKER, OutputPathError, check_writable, read_marker
from train.config import ConfigError, upgrade_stored

# what a run writes into its folder; --overwrite removes these and nothing else
RUN_ENTRIES = ("config.yaml", "checkpoints", "logs", "tb", "wandb", "predicted.json", "export")
# settings that shape a checkpoint: resuming with other values is resuming a different run
SAME_RUN_KEYS = ("target", "drafter")


class TrainingInterrupted(Exception):
    """Ctrl-C (or a signal) stopped training; the last checkpoint is on disk."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(f"training interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


def describe_run(out_dir: Path) -> str:
    if (out_dir / "export").is_dir() or (out_dir / "predicted.json").is_file():
        return "a finished run"
    if (out_dir / "checkpoints" / "last.ckpt").is_file():
        return "a run with checkpoints"
    return "a run's config"


def is_run_folder(out_dir: Path) -> bool:
    marker = read_marker(out_dir)
    return marker is not None and marker["tool"] == "train"


def mark_run_folder(out_dir: Path) -> None:
    """The marker that makes `out_dir` a run (written before anything else of the run)."""
    from export.paths import write_marker

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_marker(out_dir, "train", RUN_ENTRIES)


def check_run_folder(out_dir: Path, cfg_dict: dict, resume: str | None, overwrite: bool) -> None:
    """Refuse a launch that would overwrite what `out_dir` holds (ConfigError naming it); take
    the folder's lock."""
    from export.io import output_lock

    out_dir = Path(out_dir)
    if out_dir.is_symlink() and not out_dir.is_dir() or out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out_dir: {out_dir} is a file, not a folder")
    try:
        check_writable(out_dir, "out_dir")
        output_lock(out_dir, "out_dir")
    except OutputPathError as e:
        raise ConfigError(str(e)) from None
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not is_run_folder(out_dir):
        last = out_dir / "checkpoints" / "last.ckpt"
        hint = (f"; a run written before runs were marked continues from its checkpoint into a new folder: --resume "
                f"{last} out_dir=NEW" if last.is_file() else "")
        raise ConfigError(f"out_dir: {out_dir} is a non-empty folder that is not a draftsmith run (it carries no "
                          f"{MARKER} naming train); refusing to write into it, with or without --overwrite or "
                          f"--resume (choose another out_dir){hint}")
    if resume is not None:
        _check_same_run(out_dir, cfg_dict)
        return
    if overwrite:
        return
    raise ConfigError(f"out_dir: {out_dir} already holds {describe_run(out_dir)}; continue it with --resume, "
                      "replace it with --overwrite, or choose another out_dir")


def _check_same_run(out_dir: Path, cfg_dict: dict) -> None:
    """The run in `out_dir` is the one launched: its stored config names the same target and
    drafter. A config.yaml that cannot be read, or lacks either, is no run to continue."""
    try:
        stored = yaml.safe_load((out_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--resume: {out_dir / 'config.yaml'} cannot be read as a run's config "
                          f"({type(e).__name__}); refusing to continue into it") from None
    missing = [key for key in SAME_RUN_KEYS if not isinstance(stored, dict) or key not in stored]
    if missing:
        raise ConfigError(f"--resume: {out_dir / 'config.yaml'} is not a draftsmith run's config (no {missing[0]}); "
                          "refusing to continue into it (choose another out_dir)")
    stored = upgrade_stored(stored)  # a run written before drafter.<method> sections: its flat keys moved there
    for key in SAME_RUN_KEYS:
        old, new = stored[key], cfg_dict.get(key)
        if isinstance(old, dict) and isinstance(new, dict):  # a field added since that run is not a difference
            old, new = _flat(old), _flat(new)  # (a method's own section, drafter.<method>, compared field by field)
            changed = [sub for sub in old if old[sub] != new.get(sub)]
            if changed:
                sub = changed[0]
                raise ConfigError(f"--resume: {out_dir} holds a run with a different {key}.{sub} ({_short(old[sub])} "
                                  f"there, {_short(new.get(sub))} now); resume it with its own settings or choose "
                                  "another out_dir")
        elif old != new:
            raise ConfigError(f"--resume: {out_dir} holds a run with a different {key} ({_short(old)} there, "
                              f"{_short(new)} now); resume it with its own settings or choose another out_dir")


def _flat(tree: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested config section."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def clear_run_outputs(out_dir: Path) -> None:
    """--overwrite: remove what an earlier run wrote (only the entries a run writes, and only in a
    folder marked as a run: anything else in it, the user's notes, stays)."""
    if not Path(out_dir).is_dir() or not any(Path(out_dir).iterdir()):
        return  # (--overwrite of a new folder: nothing to clear)
    marker = read_marker(out_dir)
    if marker is None or marker["tool"] != "train":
        raise ConfigError(f"out_dir: {out_dir} is not a draftsmith run (no {MARKER} naming train); refusing to clear it")
    for name in RUN_ENTRIES:
        if name not in marker["files"]:
            continue
        path = Path(out_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def resume_command(argv: list[str]) -> str:
    """The command that continues an interrupted launch: the same arguments, without
    --resume/--overwrite, plus --resume."""
    kept, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--overwrite" or arg.startswith("--resume="):
            continue
        if arg == "--resume":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            skip = nxt.endswith(".ckpt")  # --resume PATH: the path goes too
            continue
        kept.append(arg)
    return "python -m train " + " ".join(shlex.quote(a) for a in kept + ["--resume"])
