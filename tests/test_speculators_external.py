"""External check (issue 5): the `speculators` package's own EAGLE-3 classes load draftsmith's
speculators-layout export strictly (only the verifier's tensors missing, nothing unexpected)
and compute the same first-step logits as draftsmith on the same inputs; a folder that package
saves is read back by draftsmith's reader and agrees too.

speculators 0.9.0 pins transformers <= 5.19 and datasets <= 5.1 and pulls torchvision, so it is
not a dependency: the test installs the package alone (`pip --no-deps`) into the draftsmith
cache once, and skips, saying why, where that cannot be done (no network)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_conversations, package_alone, tiny_overrides
from train.config import load_config
from train.run import run

VERSION = "0.9.0"
VERIFIER_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}


@pytest.fixture(scope="module")
def speculators_site():
    site = package_alone(f"speculators=={VERSION}")
    try:
        import pydantic  # noqa: F401  (speculators' configs are pydantic models; in the test extra)
    except ImportError:
        pytest.skip("pydantic is not installed (pip install -e '.[test]')")
    return site


@pytest.mark.parametrize("recipe,residual", [(None, False), ("configs/eagle3.yaml", False), ("configs/eagle3.yaml", True)],
                         ids=["quickstart", "eagle3-norm-before-fc", "eagle3-both-norms"])
def test_speculators_package_loads_the_export_and_agrees(speculators_site, recipe, residual, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    overrides = tiny_overrides(str(chat), tmp_path / "run", **{"trainer.max_steps": 2, "trainer.precision": "32-true",
                                                                "trainer.accelerator": "cpu", "trainer.devices": 1})
    run(load_config(recipe, overrides + ([f"drafter.eagle3.norm_before_residual={str(residual).lower()}"] if recipe else [])))
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    # the GPU recipe trains norm_before_fc (served by vLLM and SGLang); norm_before_residual on request
    assert config["norm_before_fc"] == (recipe is not None) and config["norm_before_residual"] == residual

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(speculators_site), str(Path.cwd())])}
    res = subprocess.run([sys.executable, "tests/speculators_forward.py", str(export), str(tmp_path / "theirs")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(report["unavailable"])
    assert report["unexpected"] == [], report  # nothing the package would drop
    assert set(report["missing"]) <= VERIFIER_ONLY, report  # nothing left random but the verifier's own
    assert report["max_abs_diff"] <= 1e-4 * max(1.0, report["logits_scale"]), report
    # and the other way round: a folder the package saved itself (no draftsmith.json) reads
    # into draftsmith strictly and drafts the same
    assert not (tmp_path / "theirs" / "draftsmith.json").exists()
    assert report["their_folder_read_by_draftsmith_max_abs_diff"] <= 1e-4 * max(1.0, report["logits_scale"]), report
