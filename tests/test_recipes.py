"""Every recipe runs anywhere: `accelerator: auto` and `precision: auto` resolve to the CPU and
full precision where there is no GPU (and to bf16-mixed on one), so a fast_dev_run rehearsal of
any recipe needs no override. The end-to-end rehearsal on the real zoo assets takes minutes per
recipe on 2 cores; it runs with `python -m pytest tests/test_recipes.py --rehearse-recipes`
(tests/conftest.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


def test_precision_auto_follows_the_machine():
    from train.run import resolve_precision

    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"  # an explicit choice is kept
    assert resolve_precision("auto", "auto") == ("bf16-mixed" if torch.cuda.is_available() else "32-true")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_its_trainer_on_this_machine(recipe, tmp_path):
    from train.config import load_config
    from train.run import build_trainer

    cfg = load_config(str(ROOT / "configs" / recipe), ["trainer.fast_dev_run=true"])
    trainer = build_trainer(cfg, tmp_path)
    if not torch.cuda.is_available():
        assert type(trainer.accelerator).__name__ == "CPUAccelerator"
        assert "32" in str(trainer.precision)
    assert not any(tmp_path.iterdir())  # building the trainer writes nothing


@pytest.mark.slow
@pytest.mark.rehearse
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_rehearses_on_the_cpu_without_overrides(recipe):
    res = subprocess.run([sys.executable, "-m", "train", "--config", f"configs/{recipe}", "trainer.fast_dev_run=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rehearsal (trainer.fast_dev_run) passed" in res.stdout
