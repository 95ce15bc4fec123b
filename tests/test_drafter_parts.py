"""scripts/device/drafter_parts.py: an export carried as small parts without the target's tensors
comes back byte for byte, and a wrong target or a damaged part is refused."""
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.conftest import run_module

ROOT = Path(__file__).resolve().parents[1]


def _mtp_export(tmp_path) -> Path:
    from models.draft_vocab import build_draft_vocab
    from export.formats import write_export
    from models.mtp import MTPConfig, MTPDrafter
    from models.target import Target
    from models.zoo import resolve_target

    hf_config = AutoConfig.from_pretrained(resolve_target("tiny-random-llama"))
    target = Target.load("tiny-random-llama", [])
    drafter = MTPDrafter(MTPConfig.from_target(hf_config, hf_config.vocab_size, num_modules=2))
    torch.manual_seed(0)
    with torch.no_grad():
        drafter.init_from_target(target.model, *build_draft_vocab(torch.arange(hf_config.vocab_size), hf_config.vocab_size))
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    out = tmp_path / "export"
    write_export(drafter, "mtp", out, method="mtp", target_name="tiny-random-llama", hf_config=hf_config,
                 target_model=target.model, joint=False, k=2, provenance={})
    return out


def _script(*args):
    """The script as a command, in a fresh process (what a user runs)."""
    return subprocess.run([sys.executable, "scripts/device/drafter_parts.py", *args], cwd=ROOT, capture_output=True,
                          text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def _run(*args):
    """The script's main in this process (tests.conftest.run_module): seconds of imports saved a call."""
    return run_module("scripts.device.drafter_parts", *args)


def test_pack_then_unpack_gives_the_export_back_byte_for_byte(tmp_path):
    export = _mtp_export(tmp_path)
    parts, back = tmp_path / "parts", tmp_path / "back"
    res = _script("pack", str(export), str(parts), "--target", "tiny-random-llama", "--part-mib", "0.05")
    assert res.returncode == 0, res.stderr
    assert "taken from tiny-random-llama" in res.stdout and not res.stdout.startswith("wrote parts: 0")
    sizes = [p.stat().st_size for p in parts.glob("part-*.safetensors")]
    assert len(sizes) > 1 and max(sizes) <= 0.05 * 2**20 + 4096  # cut to the size asked (rows of a big tensor too)
    assert sum(sizes) < (export / "model.safetensors").stat().st_size  # the target's copies stayed behind
    res = _script("unpack", str(parts), str(back), "--target", "tiny-random-llama")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in export.iterdir())
    for f in export.iterdir():
        assert (back / f.name).read_bytes() == f.read_bytes(), f.name
    # an existing folder is never replaced
    res = _run("unpack", str(parts), str(back), "--target", "tiny-random-llama")
    assert res.returncode == 2 and "not empty" in res.stderr


def test_a_damaged_part_is_refused_and_nothing_is_written(tmp_path):
    export = _mtp_export(tmp_path)
    parts = tmp_path / "parts"
    assert _run("pack", str(export), str(parts), "--target", "tiny-random-llama").returncode == 0
    first = sorted(parts.glob("part-*.safetensors"))[0]
    tensors = load_file(first)
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, first)
    res = _run("unpack", str(parts), str(tmp_path / "back"), "--target", "tiny-random-llama")
    assert res.returncode == 2 and "differs" in res.stderr and res.stderr.count("\n") == 1
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back.*"))


def test_staged_over_several_folders_an_export_comes_back_whole(tmp_path):
    """stage spreads the parts over .devN folders of at most --max-mib (one export over several);
    unpack takes the folders together, and refuses when one of them is missing."""
    export = _mtp_export(tmp_path)
    parts = tmp_path / "mtp-parts"
    assert _run("pack", str(export), str(parts), "--target", "tiny-random-llama", "--part-mib", "0.05").returncode == 0
    total = sum(f.stat().st_size for f in parts.iterdir()) / 2**20
    res = _run("stage", str(parts), "--into", str(tmp_path), "--max-mib", f"{total / 2.5:.4f}", "--first", "3")
    assert res.returncode == 0, res.stderr
    folders = sorted(tmp_path.glob(".dev*/mtp-parts"))
    assert len(folders) >= 3 and all(sum(f.stat().st_size for f in d.iterdir()) / 2**20 <= total / 2.5 for d in folders)
    res = _run("unpack", *map(str, folders[1:]), str(tmp_path / "partial"), "--target", "tiny-random-llama")
    assert res.returncode == 2 and ("is in none of" in res.stderr or "no parts.json" in res.stderr), res.stderr
    assert not (tmp_path / "partial").exists()
    res = _run("unpack", *map(str, folders), str(tmp_path / "back"), "--target", "tiny-random-llama")
    assert res.returncode == 0, res.stderr
    for f in export.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name
    res = _run("stage", str(parts), "--into", str(tmp_path), "--first", "3")  # never mixed into existing folders
    assert res.returncode == 2 and "exists" in res.stderr


def test_stage_refuses_two_exports_of_one_name_and_leaves_nothing_when_it_fails(tmp_path):
    export = _mtp_export(tmp_path)
    a, b = tmp_path / "a" / "mtp-parts", tmp_path / "b" / "mtp-parts"
    for parts in (a, b):
        assert _run("pack", str(export), str(parts), "--target", "tiny-random-llama").returncode == 0
    res = _run("stage", str(a), str(b), "--into", str(tmp_path))
    assert res.returncode == 2 and "share a name" in res.stderr
    not_parts = tmp_path / "c" / "x-parts"
    not_parts.mkdir(parents=True)
    res = _run("stage", str(a), str(not_parts), "--into", str(tmp_path))  # the second is checked before any copy
    assert res.returncode == 2 and "no parts.json" in res.stderr
    assert not list(tmp_path.glob(".dev*"))
