"""The method table (models/methods.py) is the one place a method lives: a toy method defined
here, registered with one row for this test only, trains, predicts, exports, passes
export.check and drafts through the same public entry points as the shipped methods."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from models import methods
from models.layers import DictConfig
from models.medusa import ResidualBlocks
from tests.conftest import tiny_overrides


# ----------------------------------------------------------------------------- the toy method
@dataclass
class ToyConfig(DictConfig):
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    target_num_layers: int
    num_heads: int = 2


class ToyDrafter(nn.Module):
    """K heads sharing one residual block over the target's final hidden state, as one matrix
    [K*Vd, H]: a Medusa relative made of existing pieces, with its own tensor names."""

    aux_layer_ids: list[int] = []

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.config = cfg
        self.block = ResidualBlocks(cfg.hidden_size, 1)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @torch.no_grad()
    def init_from_target(self, target_model, d2t, t2d):
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        rows = target_model.get_output_embeddings().weight[self.draft_ids()]
        self.lm_head.weight.copy_(rows.repeat(self.config.num_heads, 1))

    def draft_ids(self):
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def features(self, target_out):
        return target_out.last_hidden

    def train_steps(self, requested: int) -> int:
        return self.config.num_heads

    def unroll(self, input_ids, hidden, steps: int, position_ids=None, greedy: bool = False):
        if steps > self.config.num_heads:
            raise ValueError(f"{steps} drafts need {steps} toy heads; this drafter has {self.config.num_heads}")
        x = self.lm_head(self.block(hidden.to(self.lm_head.weight.dtype)))  # [B,T,K*Vd]
        return list(x.unflatten(-1, (self.config.num_heads, self.config.draft_vocab_size)).unbind(-2))[:steps]


def _build(d, hf_config, vd: int, mask_token_id: int) -> ToyDrafter:
    return ToyDrafter(ToyConfig(vocab_size=hf_config.vocab_size, draft_vocab_size=vd, hidden_size=hf_config.hidden_size,
                                target_num_layers=hf_config.num_hidden_layers))


def _toy_layout() -> types.ModuleType:
    """The toy's export layout module: the four entry points export/formats.py names."""
    from export.io import atomic_folder, check_tensors, write_export_files

    layout = types.ModuleType("toy_layout")
    fields = [f.name for f in dataclasses.fields(ToyConfig)]

    def write(drafter, out, ctx):
        tensors = {n: (t.to(ctx.dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
                   for n, t in drafter.state_dict().items()}
        with atomic_folder(out) as tmp:
            write_export_files(tmp, tensors, {"architectures": ["ToyHeadsModel"], **drafter.config.to_dict()},
                               {"format": "toy", "method": "toy", "drafter_config": drafter.config.to_dict()}, ctx.provenance)
        return Path(out)

    def reads(config):
        return (config.get("architectures") or [None])[0] == "ToyHeadsModel"

    def served_config(config, folder):
        return ToyConfig.from_dict({k: config[k] for k in fields})

    def read(folder, dtype=torch.float32, served=False):
        folder = Path(folder)
        meta = json.loads((folder / "draftsmith.json").read_text())
        cfg = served_config(json.loads((folder / "config.json").read_text()), folder) if served \
            else ToyConfig.from_dict(meta["drafter_config"])
        drafter = ToyDrafter(cfg)
        state = load_file(str(folder / "model.safetensors"))
        check_tensors(state, drafter, folder)
        drafter.load_state_dict(state, strict=True)
        return drafter.to(dtype)

    layout.write, layout.reads, layout.read, layout.served_config = write, reads, read, served_config
    layout.REQUIRED_KEYS = ("num_heads", "draft_vocab_size")
    return layout


@pytest.fixture()
def toy_method(monkeypatch):
    monkeypatch.setitem(sys.modules, "toy_layout", _toy_layout())
    monkeypatch.setitem(methods.METHODS, "toy", methods.Method(
        ToyConfig, ToyDrafter, _build, "inference.proposers.drafters:medusa_proposer", {"toy": "toy_layout"}, "heads"))


# ----------------------------------------------------------------------------- the tests
def test_a_toy_method_trains_predicts_exports_checks_and_drafts_from_one_row(toy_method, chat_file, tmp_path,
                                                                              tiny_target):
    from export.__main__ import main as export_main
    from export.check import main as check_main
    from export.load import load_export
    from inference.runtime.engine import generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import drafter_proposer
    from models.checkpoint import drafter_from_checkpoint
    from train.__main__ import main as train_main

    run = tmp_path / "run"
    assert train_main(tiny_overrides(chat_file, run, **{"drafter.method": "toy", "trainer.max_steps": 1,
                                                        "eval.k": 2})) == 0
    predicted = json.loads((run / "predicted.json").read_text())["predicted"]
    assert predicted["k"] == 2 and predicted["num_chains"] > 0 and 1.0 <= predicted["tau"] <= 3.0
    assert {p["verification"] for p in predicted["sampled"]} == {"standard", "block"}  # the sampled walk ran too

    drafter, section = drafter_from_checkpoint(run / "checkpoints" / "last.ckpt")  # the checkpoint describes it
    assert isinstance(drafter, ToyDrafter) and section["method"] == "toy"
    assert isinstance(drafter, methods.ChainDrafter)

    out = tmp_path / "toy-export"
    assert export_main(["--checkpoint", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "draftsmith.json").read_text())["format"] == "toy"
    assert check_main([str(out)]) == 0  # keys, served config, parity with the checkpoint, nothing defaulted

    rt = RuntimeModel.from_pretrained(tiny_target)
    loaded = load_export(out).eval()
    assert isinstance(loaded, ToyDrafter)
    torch.manual_seed(0)
    prompts = [torch.randint(0, rt.config.vocab_size, (n,)).tolist() for n in (5, 9)]
    plain, _ = generate(rt, prompts, 16)
    proposer = drafter_proposer(loaded, 2, len(prompts), 64, rt.config)
    assert type(proposer).__name__ == "MedusaProposer"  # the one the row names
    drafted, stats = generate(rt, prompts, 16, proposer=proposer, max_len=64)
    assert drafted == plain  # greedy speculative decoding emits exactly what plain greedy does
    assert stats.k == 2


def test_every_shipped_drafter_states_its_predictor_s_protocol():
    need = {"chain": methods.ChainDrafter, "heads": methods.ChainDrafter, "block": methods.BlockDrafter}
    for name, row in methods.METHODS.items():
        assert row.predictor in methods.PREDICTORS, name
        members = [m for m in dir(need[row.predictor]) if not m.startswith("_") and callable(getattr(need[row.predictor], m))]
        missing = [m for m in members if not callable(getattr(row.drafter, m, None))]
        assert not missing, (name, missing)
        assert row.layouts and all(isinstance(path, str) for path in row.layouts.values()), name


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown drafter method 'toy' .*known: eagle3, eagle1, medusa, mtp, dflash"):
        methods.method("toy")
    with pytest.raises(ValueError, match="ToyDrafter is the drafter of no method"):
        methods.method_of(ToyDrafter(ToyConfig(vocab_size=8, draft_vocab_size=8, hidden_size=4, target_num_layers=1)))
