"""External check (issue 17): z-lab's own DFlash model class (`dflash` 0.1.0 on PyPI, by Z Lab,
the package of github.com/z-lab/dflash) loads draftsmith's `dflash` export with nothing missing
or unexpected, builds its layers non-causal, reads the same target layers, and drafts the same
block logits as draftsmith (float32, within 1e-4).

`dflash` pins datasets and transformers versions draftsmith does not use, so it is not a
dependency: the test installs the package alone (`pip --no-deps`) into the draftsmith cache once,
and runs it in a subprocess; it skips, saying why, where that cannot be done (no network)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import package_alone

VERSION = "0.1.0"


@pytest.fixture(scope="module")
def dflash_site():
    return package_alone(f"dflash=={VERSION}")


def test_zlab_dflash_model_loads_the_export_and_its_block_logits_match(dflash_site, tiny_target, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    from export.dflash import export_dflash
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.target import Target

    hf_config = AutoConfig.from_pretrained(tiny_target)
    hf_config.num_hidden_layers = 4  # ids below the last layer: transformers' last hidden state is post-norm
    torch.manual_seed(0)
    target = LlamaForCausalLM(hf_config).eval()
    d = DFlashDrafter(DFlashConfig.from_target(hf_config, hf_config.vocab_size, 5, num_layers=2, block_size=4,
                                               target_layer_ids=[0, 2]))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    V = hf_config.vocab_size
    d.init_from_target(target, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    d.eval()
    export_dflash(d, tmp_path / "z", target_name=str(tiny_target), dtype=torch.float32)

    T, a, B = 12, 6, d.config.block_size  # a block anchored at a continues x_0..x_{a+1}
    ids = torch.randint(0, V, (1, T))
    block = torch.full((1, B), d.config.mask_token_id)
    block[0, 0] = ids[0, a + 1]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        ours = d.block_logits(ids[0], d.features(Target(target, d.aux_layer_ids)(ids))[0], torch.tensor([a]))[0, 1:]
        torch.save({"position_ids": torch.arange(a + 1 + B)[None], "noise_embedding": target.model.embed_tokens(block),
                    "hidden_states": list(out.hidden_states), "context_len": a + 1}, tmp_path / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(dflash_site), str(Path.cwd())])}
    res = subprocess.run([sys.executable, "tests/dflash_forward.py", str(tmp_path / "z"), str(tmp_path / "inputs.pt"),
                          str(tmp_path / "hidden.pt")], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["missing"] == [] and report["unexpected"] == [], report  # nothing random, nothing dropped
    assert report["causal"] == [False, False], report  # bidirectional inside the block, as trained
    assert report["target_layer_ids"] == [0, 2] and report["block_size"] == B and report["mask_token_id"] == 5
    with torch.no_grad():
        theirs = target.lm_head(torch.load(tmp_path / "hidden.pt", weights_only=True)[:, 1:])[0]
    assert theirs.shape == ours.shape == (B - 1, V)
    assert (theirs - ours).abs().max().item() <= 1e-4
