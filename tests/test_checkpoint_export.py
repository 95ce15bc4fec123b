"""Self-describing checkpoints: a .ckpt alone (its run folder deleted) exports what the run
exported, loads with weights_only=True, and a damaged one or a changed target is one error
line and exit code 2."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_conversations, tiny_overrides



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-step EAGLE-3 run (its layout needs nothing of the target), and an MTP checkpoint
    (its layout copies the target's embedding and head) written through the same section
    helpers as training, with the export training would write from that drafter."""
    from export.formats import write_export
    from models.checkpoint import describe, section_for_save
    from models.draft_vocab import build_draft_vocab
    from models.mtp import MTPConfig, MTPDrafter
    from models.target import Target
    from models.zoo import resolve_target
    from train.config import load_config
    from train.run import run
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("ckpt-runs")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    run(load_config(None, tiny_overrides(str(chat), root / "eagle3", **{
        "trainer.max_steps": 1, "checkpoint_every_n_steps": 1, "trainer.precision": "32-true", "eval.num_sequences": 2})))

    path = resolve_target("tiny-random-llama")
    hf_config, target = AutoConfig.from_pretrained(path), Target.load("tiny-random-llama", [])
    drafter = MTPDrafter(MTPConfig.from_target(hf_config, hf_config.vocab_size, num_modules=2))
    torch.manual_seed(0)
    with torch.no_grad():
        drafter.init_from_target(target.model, *build_draft_vocab(torch.arange(hf_config.vocab_size), hf_config.vocab_size))
        for p in drafter.parameters():  # trained-looking weights: the initial ones would prove less
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    description = describe("mtp", "tiny-random-llama", path, hf_config, {"eval": {"k": 2}})
    mtp = root / "mtp"
    (mtp / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()}, "global_step": 1,
                "draftsmith": section_for_save(description, drafter)}, mtp / "checkpoints" / "last.ckpt")
    write_export(drafter, "mtp", mtp / "export", method="mtp", target_name="tiny-random-llama", hf_config=hf_config,
                 target_model=target.model, joint=False, k=2, provenance={})
    return {"eagle3": root / "eagle3", "mtp": mtp}


def _only_the_checkpoint(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run folder with everything deleted but checkpoints/last.ckpt."""
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    for p in sorted(copy.rglob("*"), reverse=True):
        if p.is_file() and p != copy / "checkpoints" / "last.ckpt":
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    assert [p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()] == ["checkpoints/last.ckpt"]
    return copy / "checkpoints" / "last.ckpt"


def _same_export(a: Path, b: Path):
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(x) == set(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_every_checkpoint_loads_as_plain_data_and_rebuilds_its_drafter(runs):
    from models.checkpoint import drafter_from_checkpoint

    ckpts = sorted((runs["eagle3"] / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in ckpts] == ["last.ckpt", "step1.ckpt"]
    for path in ckpts:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        section = ckpt["draftsmith"]
        assert section["method"] == "eagle3" and section["target"]["name"] == "tiny-random-llama"
        assert len(section["target"]["weights_sha256"]) == 64 and section["run_config"]["eval"]["k"] == 3
        drafter, _ = drafter_from_checkpoint(path)
        state = {k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items()}
        assert all(torch.equal(v, state[k]) for k, v in drafter.state_dict().items())


def test_the_checkpoint_alone_exports_what_the_run_exported_without_importing_train(runs, tmp_path):
    ckpt = _only_the_checkpoint(runs["eagle3"], tmp_path)
    out = tmp_path / "exported"
    # run as a user would, then list which of train's modules (or Lightning) were imported
    code = ("import sys; from export.__main__ import main; code = main(sys.argv[1:]); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('train', 'lightning')); "
            "print('imported:', bad); sys.exit(code or (3 if bad else 0))")
    res = subprocess.run([sys.executable, "-c", code, "--checkpoint", str(ckpt), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "imported: []" in res.stdout
    _same_export(runs["eagle3"] / "export", out)
    meta = json.loads((out / "draftsmith.json").read_text())
    assert meta["format"] == "speculators" and meta["training_config"]["target"] == "tiny-random-llama"
    assert meta["predicted_acceptance"]["step"] == 1  # stored in the checkpoint, not read from predicted.json


def test_a_layout_that_copies_the_target_loads_it_by_its_recorded_identity(runs, tmp_path):
    from export.__main__ import main

    ckpt = _only_the_checkpoint(runs["mtp"], tmp_path)
    assert main(["--checkpoint", str(ckpt), "--format", "mtp"]) == 0
    _same_export(runs["mtp"] / "export", ckpt.parent / "last-mtp")


def _damaged(runs, tmp_path, method, change) -> Path:
    ckpt = torch.load(runs[method] / "checkpoints" / "last.ckpt", weights_only=True)
    change(ckpt)
    path = tmp_path / "damaged.ckpt"
    torch.save(ckpt, path)
    return path


def _shrink(ckpt):
    ckpt["state_dict"]["drafter.fc.weight"] = ckpt["state_dict"]["drafter.fc.weight"][:-1].clone()


def _other_hash(ckpt):
    ckpt["draftsmith"]["target"]["weights_sha256"] = "0" * 64


DAMAGE = [  # (method, change, what the one error line must say)
    ("eagle3", lambda c: c["state_dict"].pop("drafter.fc.weight"), "missing tensors ['fc.weight']"),
    ("eagle3", _shrink, "tensor fc.weight has shape"),
    ("eagle3", lambda c: c.pop("draftsmith"), "does not describe itself"),
    ("eagle3", lambda c: c["draftsmith"].pop("drafter_config"), "section lacks drafter_config"),
    ("mtp", _other_hash, "is not the 0000000000000000 the checkpoint was trained against"),
]


@pytest.mark.parametrize("method,change,said", DAMAGE, ids=["removed", "reshaped", "old", "no-config", "other-target"])
def test_a_damaged_checkpoint_or_another_target_is_one_error_line(runs, tmp_path, capsys, method, change, said):
    from export.__main__ import main

    path = _damaged(runs, tmp_path, method, change)
    out = tmp_path / "out"
    assert main(["--checkpoint", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and said in err, err
    assert not out.exists()
