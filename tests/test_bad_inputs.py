"""Runs the bad-input corpus (tests/bad_inputs.py): every row through its command's main(argv),
in process. Each must exit with its code, print one `error:` line holding its phrase and no
traceback, leave the user's files byte for byte as they were, and create nothing."""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from tests.bad_inputs import CASES
from tests.conftest import make_conversations, tiny_overrides

MAINS = {"train": "train.__main__", "export": "export.__main__", "export.check": "export.check",
         "generate": "inference.generate", "validate": "inference.validate", "bench": "inference.bench",
         "regenerate": "inference.regenerate", "promise": "train.promise",
         "extract": "train.extract"}


class _RunsCode:
    """Unpickling this runs code: what a hostile .ckpt does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _fake_run(root: Path, name: str, source_run: Path, ckpt_bytes: bytes) -> Path:
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(source_run / "config.yaml", run / "config.yaml")
    (run / "checkpoints" / "last.ckpt").write_bytes(ckpt_bytes)
    return run


@pytest.fixture(scope="session")
def world(tmp_path_factory, tiny_target) -> dict:
    """The user's things and the hostile inputs every case may name (see tests/bad_inputs.py)."""
    from train.config import load_config
    from train.run import run

    root = tmp_path_factory.mktemp("bad_inputs")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    finished = root / "run"
    run(load_config(None, tiny_overrides(str(chat), finished, **{"trainer.max_steps": 2})))
    export = root / "export"
    shutil.copytree(finished / "export", export)
    userfile = root / "notes.txt"
    userfile.write_text("the user's own notes\n")
    userdir = root / "mine"
    userdir.mkdir()
    (userdir / "thesis.md").write_text("# years of work\n")
    marker = root / "pwned"
    evil = root / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _RunsCode(str(marker))}, evil)
    ckpt = (finished / "checkpoints" / "last.ckpt").read_bytes()
    trunc = root / "truncated.ckpt"
    trunc.write_bytes(ckpt[: len(ckpt) // 3])
    truncst = root / "truncated-target"
    shutil.copytree(tiny_target, truncst)
    weights = (truncst / "model.safetensors").read_bytes()
    (truncst / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    notemplate = root / "no-template-target"
    shutil.copytree(tiny_target, notemplate)
    (notemplate / "chat_template.jinja").unlink(missing_ok=True)
    truncgguf = root / "truncated.gguf"
    truncgguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 20)
    nonutf8 = root / "latin1.jsonl"
    nonutf8.write_bytes(chat.read_bytes()[:200] + b"\n" + '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'.encode("latin-1"))
    twochats = root / "two.jsonl"
    twochats.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)[:2]))
    norole = root / "norole.jsonl"
    norole.write_text(json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    badmeta = root / "bad-meta-export"
    shutil.copytree(export, badmeta)
    (badmeta / "draftsmith.json").write_text("{not json")
    badconfig = root / "bad-config-export"
    shutil.copytree(export, badconfig)
    (badconfig / "config.json").write_text("{not json")
    more = _more_world(root, finished, export, chat, tiny_target)
    return {**more, "badmeta": badmeta, "badconfig": badconfig, "run": finished, "export": export, "userfile": userfile, "userdir": userdir, "fresh": root / "fresh",
            "chat": chat, "twochats": twochats, "nonutf8": nonutf8, "norole": norole, "evilckpt": evil,
            "evilrun": _fake_run(root, "evil-run", finished, evil.read_bytes()), "truncckpt": trunc,
            "truncrun": _fake_run(root, "trunc-run", finished, trunc.read_bytes()), "truncst": truncst,
            "truncgguf": truncgguf, "notemplate": notemplate, "marker": marker,
            "longprompt": "draft " * 4500}


def _export_with(root: Path, export: Path, name: str, change, rehash: bool = True) -> Path:
    """A copy of the export whose weights `change` edits ({name: tensor} in place); rehash:
    draftsmith.json records the new weights' sha256 (so the hash check passes and the edit is what
    is refused)."""
    from safetensors.torch import load_file, save_file

    out = root / name
    shutil.copytree(export, out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if rehash:
        meta = json.loads((out / "draftsmith.json").read_text())
        meta["weights_sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        (out / "draftsmith.json").write_text(json.dumps(meta))
    return out


def _more_world(root: Path, finished: Path, export: Path, chat: Path, tiny_target) -> dict:
    """The inputs of issue 52's rows: damaged exports, malformed prompt files, folders of other
    tools."""
    w = {}
    w["nanexport"] = _export_with(root, export, "nan-export", lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")))
    w["intexport"] = _export_with(root, export, "int-export",
                                  lambda t: t.__setitem__("norm.weight", t["norm.weight"].to(torch.int32)))
    w["editedexport"] = _export_with(root, export, "edited-export",
                                     lambda t: t["fc.weight"].__setitem__((0, 0), 0.5), rehash=False)
    zero = root / "zero-export"
    shutil.copytree(export, zero)
    (zero / "model.safetensors").write_bytes(b"")
    w["zeroexport"] = zero
    cut = root / "cut-export"
    shutil.copytree(export, cut)
    data = (export / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    w["cutexport"] = cut
    for name, row in (("listprompt", {"prompt": ["a", "b"]}), ("nullcategory", {"prompt": "hi", "category": None}),
                      ("noprompt", {"question": "hi", "id": 1})):
        (root / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        w[name] = root / f"{name}.jsonl"
    other = root / "other-target"  # the tiny target's architecture with other weights
    shutil.copytree(tiny_target, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    for tensor in weights.values():
        tensor.mul_(0.5) if tensor.is_floating_point() else None
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    w["othertarget"] = other
    md = root / "notes-md"
    md.mkdir()
    (md / "a.md").write_text("# a note\n")
    (md / "b.md").write_text("# another\n")
    w["mdfolder"] = md
    project = root / "hydra-project"  # a folder of another tool with a config.yaml, logs/, export/
    (project / "logs").mkdir(parents=True)
    (project / "export").mkdir()
    (project / "config.yaml").write_text("defaults:\n  - model: llama\nlr: 0.001\n")
    (project / "logs" / "train.log").write_text("epoch 1\n")
    (project / "export" / "model.onnx").write_bytes(b"onnx")
    w["project"] = project
    results = root / "results"  # another tool's report.json beside other results
    results.mkdir()
    (results / "report.json").write_text('{"score": 0.9}')
    (results / "log.txt").write_text("other results\n")
    w["results"] = results
    withckpt = root / "export-with-checkpoint"  # an export the user put the checkpoint and notes into
    shutil.copytree(export, withckpt)
    shutil.copy(finished / "checkpoints" / "last.ckpt", withckpt / "mine.ckpt")
    w["exportckpt"] = withckpt
    w["ownckpt"] = withckpt / "mine.ckpt"
    return w


def _fill(text: str, world: dict) -> str:
    return text.format(**{k: str(v) for k, v in world.items()})


def _digest(path: Path) -> dict:
    """{relative path: sha256} of a file or every file under a folder (or {} when absent)."""
    path = Path(path)
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    if not path.exists():
        return {}
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def _call(cli: str, argv: list[str]) -> int:
    try:
        return importlib.import_module(MAINS[cli]).main(argv)
    except SystemExit as e:  # argparse usage errors
        return e.code


@pytest.fixture(autouse=True)
def _quiet_root_logger():
    """main()s configure logging onto the stream pytest captures for that case only."""
    yield
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, world, capsys):
    case = CASES[name]
    argv = [_fill(a, world) for a in case.argv]
    if case.tiny_train:
        argv = tiny_overrides(str(world["chat"]), world["fresh"]) + argv
    unchanged = {p: _digest(Path(_fill(p, world))) for p in case.unchanged}
    code = _call(case.cli, argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == case.code, f"exit {code}, expected {case.code}: {err[-2000:]}"
    assert len(errors) == 1 and case.phrase in errors[0], err[-2000:]
    for p, before in unchanged.items():
        assert _digest(Path(_fill(p, world))) == before, f"{p} changed"
    for p in case.absent:
        assert not Path(_fill(p, world)).exists(), f"{p} was created"


def test_the_corpus_covers_every_command():
    from collections import Counter

    per_cli = Counter(c.cli for c in CASES.values())
    assert set(per_cli) == set(MAINS) and len(CASES) >= 60, per_cli


@pytest.mark.parametrize("cli,flag,default", [
    ("train", "--config", "None"), ("export", "--dtype", "bfloat16"), ("export.check", "--target", "None"),
    ("generate", "--max-new-tokens", "256"), ("validate", "--tolerance", "0.1"), ("bench", "--num-prompts", "20"),
    ("regenerate", "--max-new-tokens", "512")])
def test_every_help_shows_the_defaults(cli, flag, default, capsys):
    assert _call(cli, ["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    options = out[out.index("options:"):]
    after = options[options.index(flag):]
    assert f"(default: {default})" in after[:400], after[:400]


def test_a_drafter_given_is_the_drafter_used():
    from inference.cli import CliError
    from inference.generate import choose_proposer

    assert choose_proposer(None, "runs/x/export", None) == "drafter"
    assert choose_proposer(None, None, "tiny-random-llama") == "draft-model"
    assert choose_proposer(None, None, None) == "ngram"
    assert choose_proposer("medusa", "runs/x/export", None) == "medusa"
    with pytest.raises(CliError, match="--drafter runs/x/export would be ignored by --proposer suffix"):
        choose_proposer("suffix", "runs/x/export", None)


def test_a_read_only_output_folder_is_one_line(world, tmp_path, capsys, monkeypatch):
    import os
    import tempfile

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if not hasattr(os, "geteuid") or os.geteuid() == 0:
        # root writes through permission bits (CI runs as root): the refusal the OS gives an
        # ordinary user is given here for this one folder, so the same path is exercised
        real_mkstemp = tempfile.mkstemp

        def refuse(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == locked:
                raise PermissionError(13, "Permission denied")
            return real_mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    try:
        code = _call("export", ["--checkpoint", str(world["run"]), "--format", "speculators", "--out", str(locked / "x")])
        assert code == 2 and "cannot write in" in capsys.readouterr().err
        assert _call("train", tiny_overrides(str(world["chat"]), locked / "run")) == 2
        assert "cannot write in" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)
