"""Issue 52's four ways a command destroyed a user's files with exit 0, each now refused.

A folder is draftsmith's output only when it carries draftsmith's own marker
(export/paths.py: MARKER, naming the command that wrote it and the files it wrote), never
because of a file name; replacing one removes only what the command wrote there and never the
command's own input. Each test builds the folder a user had, runs the command as the issue ran
it, and asserts exit 2, one `error:` line, and every file byte for byte as it was.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import make_conversations, tiny_overrides


def _digest(folder: Path) -> dict:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(folder).rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny finished run (2 steps) and its chat file."""
    from train.config import load_config
    from train.run import run

    root = tmp_path_factory.mktemp("data_loss")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    out = root / "run"
    run(load_config(None, tiny_overrides(str(chat), out, **{"trainer.max_steps": 2})))
    return {"run": out, "chat": chat, "ckpt": out / "checkpoints" / "last.ckpt"}


def _one_error(err: str, phrase: str):
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and phrase in errors[0], err[-2000:]


@pytest.mark.parametrize("where", [".", "sub"])
def test_export_force_never_removes_its_own_checkpoint_or_the_users_notes(finished, tmp_path, capsys, where):
    """Case 1: `export --checkpoint DIR/mine.ckpt --out DIR --force` (the checkpoint in DIR or
    in a subfolder of it) once removed DIR whole, the checkpoint and the user's notes in it."""
    from export.__main__ import main

    out = tmp_path / "DIR"
    assert main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out)]) == 0
    (out / where).mkdir(exist_ok=True)
    mine = out / where / "mine.ckpt"
    shutil.copy(finished["ckpt"], mine)
    (out / "notes.txt").write_text("the user's notes\n")
    before = _digest(out)
    capsys.readouterr()
    code = main(["--checkpoint", str(mine), "--format", "speculators", "--out", str(out), "--force"])
    _, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    _one_error(err, "this command's input")
    assert _digest(out) == before


def test_export_force_keeps_a_file_the_user_added(finished, tmp_path, capsys):
    """Case 1, the notes alone: an export folder the user added a file to is not replaced."""
    from export.__main__ import main

    out = tmp_path / "export"
    assert main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("the user's notes\n")
    before = _digest(out)
    capsys.readouterr()
    assert main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out), "--force"]) == 2
    _one_error(capsys.readouterr().err, "notes.txt that export did not write")
    assert _digest(out) == before


def test_export_force_replaces_its_own_export(finished, tmp_path, capsys):
    """What --force is for still works: an export holding only what export wrote is replaced,
    and the new one carries the marker naming its files (model.safetensors 0644 like config.json)."""
    from export.__main__ import main
    from export.paths import MARKER, read_marker

    out = tmp_path / "export"
    args = ["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out)]
    assert main(args) == 0
    assert main(args + ["--force", "--dtype", "float32"]) == 0
    marker = read_marker(out)
    assert marker["tool"] == "export" and "model.safetensors" in marker["files"]
    assert sorted(p.name for p in out.iterdir()) == sorted(marker["files"] + [MARKER])
    assert json.loads((out / "draftsmith.json").read_text())["format"] == "speculators"
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], list(tmp_path.iterdir())


def test_export_into_a_folder_named_like_an_export_is_refused(finished, tmp_path, capsys):
    """A folder holding a draftsmith.json (by name) but no marker is not an export."""
    from export.__main__ import main

    out = tmp_path / "looks-like-export"
    out.mkdir()
    (out / "draftsmith.json").write_text(json.dumps({"method": "eagle3", "format": "speculators"}))
    (out / "thesis.md").write_text("# years of work\n")
    before = _digest(out)
    assert main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out), "--force"]) == 2
    _one_error(capsys.readouterr().err, "not a draftsmith export")
    assert _digest(out) == before


def test_validate_never_replaces_a_folder_because_it_holds_a_report_json(finished, tmp_path, capsys):
    """Case 2: `inference.validate --out DIR` where DIR holds another tool's report.json and
    other files: the folder was replaced whole."""
    from inference.validate import main

    out = tmp_path / "results"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"tool": "another", "score": 0.9}))
    (out / "run-log.txt").write_text("other results\n")
    before = _digest(out)
    code = main(["--drafter", str(finished["run"] / "export"), "--dataset", "mt-bench", "--device", "cpu",
                 "--num-prompts", "1", "--max-new-tokens", "4", "--max-turns", "1", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    _one_error(err, "not a draftsmith validate output")
    assert _digest(out) == before


def test_validate_keeps_a_file_the_user_added_to_its_report(tmp_path):
    """Case 2, this project's own report folder with a file the user added: not replaced."""
    from export.io import atomic_folder
    from export.paths import OutputPathError

    out = tmp_path / "validation"
    with atomic_folder(out, tool="validate") as tmp:
        (tmp / "report.json").write_text("{}")
    (out / "my-notes.md").write_text("why it failed\n")
    before = _digest(out)
    with pytest.raises(OutputPathError, match="my-notes.md that validate did not write"):
        with atomic_folder(out, tool="validate") as tmp:
            (tmp / "report.json").write_text("{}")
    assert _digest(out) == before


def _hydra_folder(root: Path) -> Path:
    """A Hydra-style project folder: config.yaml, logs/, tb/, export/ of its own."""
    folder = root / "project"
    (folder / "logs").mkdir(parents=True)
    (folder / "tb").mkdir()
    (folder / "export").mkdir()
    (folder / "config.yaml").write_text("defaults:\n  - model: llama\nlr: 0.001\n")
    (folder / "logs" / "train.log").write_text("epoch 1 ...\n")
    (folder / "tb" / "events.out").write_bytes(b"\x00\x01tensorboard")
    (folder / "export" / "model.onnx").write_bytes(b"onnx weights")
    return folder


def test_train_overwrite_never_clears_a_folder_because_it_holds_a_config_yaml(finished, tmp_path, capsys):
    """Case 3: `python -m train out_dir=DIR --overwrite` into a Hydra project folder removed its
    config.yaml, logs/, tb/ and export/."""
    from train.__main__ import main

    folder = _hydra_folder(tmp_path)
    before = _digest(folder)
    code = main(tiny_overrides(str(finished["chat"]), folder, **{"trainer.max_steps": 1}) + ["--overwrite"])
    _, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    _one_error(err, "not a draftsmith run")
    assert _digest(folder) == before


def test_train_without_overwrite_does_not_call_a_project_folder_a_run(finished, tmp_path, capsys):
    """Case 3's refusal without the flag: not "a finished run", and no suggestion of --overwrite."""
    from train.__main__ import main

    folder = _hydra_folder(tmp_path)
    assert main(tiny_overrides(str(finished["chat"]), folder, **{"trainer.max_steps": 1})) == 2
    err = capsys.readouterr().err
    _one_error(err, "not a draftsmith run")
    assert "finished run" not in err and "replace it with --overwrite" not in err


def test_train_resume_into_a_project_folder_is_refused(finished, tmp_path, capsys):
    """Case 4: `python -m train out_dir=DIR --resume CKPT` into such a folder overwrote its
    config.yaml and export/ (the same-run check was skipped: the YAML had no target/drafter)."""
    from train.__main__ import main

    folder = _hydra_folder(tmp_path)
    before = _digest(folder)
    code = main(tiny_overrides(str(finished["chat"]), folder, **{"trainer.max_steps": 3})
                + ["--resume", str(finished["ckpt"])])
    _, err = capsys.readouterr()
    assert code == 2, err[-2000:]
    _one_error(err, "not a draftsmith run")
    assert _digest(folder) == before


def test_resume_needs_a_runs_config_even_in_a_marked_folder(finished, tmp_path):
    """Case 4's second half: a run folder whose config.yaml lacks target/drafter is no run to
    continue (the same-run check is never skipped)."""
    from train.config import ConfigError
    from train.run_folder import check_run_folder, mark_run_folder
    from export.io import release_output_locks

    folder = tmp_path / "run"
    mark_run_folder(folder)
    (folder / "config.yaml").write_text("lr: 0.001\n")
    try:
        with pytest.raises(ConfigError, match="not a draftsmith run's config"):
            check_run_folder(folder, {"target": "t", "drafter": {}}, str(finished["ckpt"]), False)
    finally:
        release_output_locks()


def test_overwrite_removes_only_what_a_run_wrote(finished, tmp_path, capsys):
    """--overwrite of a real run: its entries go, a file the user added to the folder stays."""
    from train.__main__ import main

    folder = tmp_path / "run"
    shutil.copytree(finished["run"], folder)
    (folder / "notes.txt").write_text("kept\n")
    assert main(tiny_overrides(str(finished["chat"]), folder, **{"trainer.max_steps": 1}) + ["--overwrite"]) == 0
    assert (folder / "notes.txt").read_text() == "kept\n"
    assert not (folder / "checkpoints" / "step2.ckpt").exists()  # the earlier run's step-2 checkpoint went


# ---- issue 52's "silent or unsafe": locks, stale temporaries, Ctrl-C, a training still running


def _hold_lock(folder: Path):
    """A second process holding `folder`'s output lock (as a running command does); returns it
    once it holds the lock."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom export.io import output_lock\n"
                             f"output_lock({str(folder)!r})\nprint('locked', flush=True)\ntime.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_command_into_a_folder_in_use_is_one_line(finished, tmp_path, capsys):
    """Two trainings into one out_dir, two validations (or regenerations) into one --out, or an
    export into a folder being written: the second is refused in one line naming the holder."""
    from export.__main__ import main as export_main
    from train.__main__ import main as train_main
    from inference.regenerate import main as regenerate_main

    out = tmp_path / "busy"
    holder = _hold_lock(out)
    try:
        assert train_main(tiny_overrides(str(finished["chat"]), out)) == 2
        _one_error(capsys.readouterr().err, f"is being written by another process (pid {holder.pid})")
        assert export_main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out)]) == 2
        _one_error(capsys.readouterr().err, "is being written by another process")
        assert regenerate_main(["--target", "tiny-random-llama", "--dataset", str(finished["chat"]), "--device", "cpu",
                                "--out", str(out)]) == 2
        _one_error(capsys.readouterr().err, "is being written by another process")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_an_export_of_a_training_in_progress_takes_a_step_checkpoint(finished, tmp_path, capsys):
    """last.ckpt changes while training runs: export takes the newest stepN.ckpt (and records
    it), or refuses while there is none."""
    from export.__main__ import main

    run = tmp_path / "running"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(finished["ckpt"], run / "checkpoints" / "last.ckpt")
    holder = _hold_lock(run)
    try:
        assert main(["--checkpoint", str(run), "--format", "speculators", "--out", str(tmp_path / "a")]) == 2
        _one_error(capsys.readouterr().err, "is training now and has written no step checkpoint yet")
        shutil.copy(finished["ckpt"], run / "checkpoints" / "step2.ckpt")
        shutil.copy(finished["ckpt"], run / "checkpoints" / "step10.ckpt")
        assert main(["--checkpoint", str(run), "--format", "speculators", "--out", str(tmp_path / "b")]) == 0
        assert "exporting its newest step checkpoint, step10.ckpt" in capsys.readouterr().err
        recorded = json.loads((tmp_path / "b" / "draftsmith.json").read_text())["checkpoint"]
        assert recorded == str((run / "checkpoints" / "step10.ckpt").resolve())
    finally:
        holder.kill()
        holder.wait()


def test_stale_temporaries_of_a_killed_export_are_removed_by_the_next(tmp_path):
    """SIGKILL mid-write leaves `.NAME.tmp-*` (and `.NAME.old-*`) beside --out: the next write
    to the same --out removes them; other hidden files stay."""
    from export.io import atomic_folder

    out = tmp_path / "validation"
    for stale in (".validation.tmp-x1y2", ".validation.old-1234"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "report.json").write_text("{}")
    (tmp_path / ".keep-me").write_text("the user's\n")
    with atomic_folder(out, tool="validate") as tmp:
        (tmp / "report.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keep-me", "validation"]


def test_ctrl_c_during_export_is_one_line(finished, tmp_path, capsys, monkeypatch):
    import export.__main__ as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_export", interrupted)
    out = tmp_path / "export"
    assert cli.main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [f"interrupted: nothing was written to {out}"]
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line(finished, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own error, torch as a RuntimeError: both become
    an OSError naming the file, which the commands print in one line."""
    from safetensors import SafetensorError

    import export.io
    from export.__main__ import main
    from train.checkpoint_io import make_checkpoint_io

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(export.io, "save_file", full)
    assert main(["--checkpoint", str(finished["ckpt"]), "--format", "speculators", "--out", str(tmp_path / "e")]) == 2
    _one_error(capsys.readouterr().err, "model.safetensors: could not be written")
    assert list(tmp_path.iterdir()) == []

    def torch_full(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0\nfile write failed")

    monkeypatch.setattr("torch.save", torch_full)
    with pytest.raises(OSError, match="last.ckpt: the checkpoint could not be written .*file write failed"):
        make_checkpoint_io().save_checkpoint({"x": 1}, tmp_path / "c" / "last.ckpt")
    assert list((tmp_path / "c").iterdir()) == []


def test_export_check_holds_the_export_to_the_checkpoints_own_record(finished, tmp_path, capsys):
    """An edit made in both config.json and draftsmith.json (a norm flag) passed export.check:
    parity was built from draftsmith.json. A checkpoint of another method is a problem line, not
    a traceback."""
    import torch

    from export.check import main
    from models.checkpoint import SECTION

    out = tmp_path / "edited"
    shutil.copytree(finished["run"] / "export", out)
    for name, edit in (("draftsmith.json", lambda d: d["drafter_config"].__setitem__("norm_before_residual", True)),
                       ("config.json", lambda d: d.__setitem__("norm_before_residual", True))):
        data = json.loads((out / name).read_text())
        edit(data)
        (out / name).write_text(json.dumps(data))
    assert main([str(out)]) == 1
    printed = capsys.readouterr().out
    assert "drafter norm_before_residual: True in the export, False in the checkpoint" in printed, printed

    other = tmp_path / "other-method.ckpt"
    ckpt = torch.load(finished["ckpt"], weights_only=True)
    ckpt[SECTION] = {**ckpt[SECTION], "method": "medusa"}
    torch.save(ckpt, other)
    assert main([str(finished["run"] / "export"), "--checkpoint", str(other)]) == 1
    out_, err = capsys.readouterr()
    assert "Traceback" not in err and "holds a medusa drafter, the export a eagle3 one" in out_, out_ + err


def test_a_pickle_planted_in_the_token_count_cache_is_refused_by_name(finished, tmp_path):
    """The token counts training caches load with weights_only: a planted pickle is refused in
    one line naming the file (and its code never runs)."""
    import torch
    from transformers import AutoTokenizer

    from data.chat import dataset_key
    from data.sources import DataError
    from models.zoo import cache_dir, resolve_target
    from train.config import load_config
    from train.run import prepare_data

    chat = tmp_path / "chat.jsonl"
    shutil.copy(finished["chat"], chat)
    cfg = load_config(None, tiny_overrides(str(chat), tmp_path / "run"))
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target))
    vocab = 49152
    prepare_data(cfg, tokenizer, vocab)  # tokenized, counts cached
    key = dataset_key(cfg.data.dataset, tokenizer, cfg.data.max_length, cfg.data.limit, cfg.data.heldout_fraction,
                      cfg.data.plain_text)
    counts = cache_dir() / "datasets" / key / "token_counts.pt"
    marker = tmp_path / "pwned"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    try:
        torch.save({"counts": RunsCode()}, counts)
        with pytest.raises(DataError, match="token_counts.pt: not the token counts draftsmith caches"):
            prepare_data(cfg, tokenizer, vocab)
        assert not marker.exists()
    finally:
        shutil.rmtree(counts.parent, ignore_errors=True)


def test_a_hub_data_set_that_cannot_be_fetched_is_one_line(monkeypatch):
    import datasets

    from data.sources import DataError, load_conversations

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nobody/none' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="'nobody/none': not a zoo name or an existing file, and the Hugging Face hub "
                                        "does not give it"):
        load_conversations("nobody/none")
