"""The method table (models/methods.py) is the one place a method lives: a toy method defined
here, with its own run-config section (`drafter.toy`, fields no source file names), registered
through the table's public API (`methods.register`) for this test only, trains, predicts,
exports, passes export.check and drafts through the same public entry points as the shipped
methods."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from models import methods
from models.layers import DictConfig
from models.medusa import ResidualBlocks
from models.options import MethodOptions, positive_int
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


@dataclass
class ToyOptions(MethodOptions):
    """The toy's run-config section, `drafter.toy`: its field is named nowhere in the sources."""

    stacked_heads: int = 2
    """Heads of the toy drafter; head k predicts the token k+1 positions after the last verified one."""

    RANGES: ClassVar[tuple] = (("stacked_heads", positive_int, "a positive integer"),)
    RENAMED: ClassVar[dict] = {"toy_heads": "stacked_heads"}

    def problems(self, run, key: str) -> list[str]:
        if run.eval.k > self.stacked_heads:
            return [f"eval.k: {run.eval.k} drafts need {run.eval.k} toy heads; {key}.stacked_heads is {self.stacked_heads}"]
        return []


def _build(d, hf_config, vd: int, mask_token_id: int) -> ToyDrafter:
    return ToyDrafter(ToyConfig(vocab_size=hf_config.vocab_size, draft_vocab_size=vd, hidden_size=hf_config.hidden_size,
                                target_num_layers=hf_config.num_hidden_layers, num_heads=d.options.stacked_heads))


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
    methods.register("toy", methods.Method(ToyConfig, ToyDrafter, _build, "inference.proposers.drafters:medusa_proposer",
                                           {"toy": "toy_layout"}, "heads", options=ToyOptions, display_name="Toy",
                                           max_drafts=lambda c: c.num_heads))
    yield
    del methods.METHODS["toy"]


SOURCES = ("train", "models", "export", "inference", "data", "kernels")


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

    root = Path(__file__).resolve().parents[1]
    named = [str(f.relative_to(root)) for package in SOURCES for f in (root / package).rglob("*.py")
             if "stacked_heads" in f.read_text()]
    assert not named  # the toy's field lives in this file alone: no source file had to learn it

    run = tmp_path / "run"
    assert train_main(tiny_overrides(chat_file, run, **{"drafter.method": "toy", "drafter.toy.stacked_heads": 3,
                                                        "trainer.max_steps": 1, "eval.k": 2})) == 0
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["drafter"]["toy"] == {"stacked_heads": 3}
    predicted = json.loads((run / "predicted.json").read_text())["predicted"]
    assert predicted["k"] == 2 and predicted["num_chains"] > 0 and 1.0 <= predicted["tau"] <= 3.0
    assert {p["verification"] for p in predicted["sampled"]} == {"standard", "block"}  # the sampled walk ran too

    drafter, section = drafter_from_checkpoint(run / "checkpoints" / "last.ckpt")  # the checkpoint describes it
    assert isinstance(drafter, ToyDrafter) and section["method"] == "toy"
    assert drafter.config.num_heads == 3  # the toy's own field reached its module
    assert section["run_config"]["drafter"]["toy"] == {"stacked_heads": 3}  # and the resolved config records it
    assert isinstance(drafter, methods.ChainDrafter)

    out = tmp_path / "toy-export"
    assert export_main(["--checkpoint", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    meta = json.loads((out / "draftsmith.json").read_text())
    assert meta["format"] == "toy" and meta["drafter_config"]["num_heads"] == 3
    assert check_main([str(out)]) == 0  # keys, served config, parity with the checkpoint, nothing defaulted

    rt = RuntimeModel.from_pretrained(tiny_target)
    loaded = load_export(out).eval()
    assert isinstance(loaded, ToyDrafter) and loaded.config.num_heads == 3
    torch.manual_seed(0)
    prompts = [torch.randint(0, rt.config.vocab_size, (n,)).tolist() for n in (5, 9)]
    plain, _ = generate(rt, prompts, 16)
    proposer = drafter_proposer(loaded, 2, len(prompts), 64, rt.config)
    assert type(proposer).__name__ == "MedusaProposer"  # the one the row names
    drafted, stats = generate(rt, prompts, 16, proposer=proposer, max_len=64)
    assert drafted == plain  # greedy speculative decoding emits exactly what plain greedy does
    assert stats.k == 2

    from inference.bench import _drafter_ks, _drafter_name

    assert _drafter_name(loaded) == "Toy" and _drafter_ks(loaded, [2, 5]) == [2]  # the bench reads the row
    with pytest.raises(ValueError, match="draft trees are drafted by EAGLE-3 drafters.*not by this Toy drafter"):
        from models.methods import check_tree_drafter

        check_tree_drafter(loaded)


def test_a_toy_method_s_own_fields_are_typed_ranged_and_checked_by_its_class(toy_method, chat_file, tmp_path):
    from train.config import ConfigError, load_config

    def config(**extra):
        return load_config(None, tiny_overrides(chat_file, tmp_path / "run", **{"drafter.method": "toy", "eval.k": 2,
                                                                                 **extra}))

    assert config().drafter.options == ToyOptions(stacked_heads=2)  # defaults where the config gives none
    assert config(**{"drafter.toy.stacked_heads": 5}).to_dict()["drafter"]["toy"] == {"stacked_heads": 5}
    for extra, message in [({"drafter.toy.stacked_heads": "many"}, "drafter.toy.stacked_heads: expected an integer"),
                           ({"drafter.toy.stacked_heads": 0}, "drafter.toy.stacked_heads: must be a positive integer, got 0"),
                           ({"drafter.toy.stacked_heads": 3, "eval.k": 4},
                            "eval.k: 4 drafts need 4 toy heads; drafter.toy.stacked_heads is 3"),
                           ({"drafter.toy.stacked_head": 3}, "unknown key 'drafter.toy.stacked_head' .did you mean drafter.toy.stacked_heads"),
                           ({"drafter.toy_heads": 3}, "unknown key 'drafter.toy_heads' .it is drafter.toy.stacked_heads now"),
                           ({"drafter.medusa.heads": 3}, "drafter.medusa: a section of method medusa, but drafter.method is toy")]:
        with pytest.raises(ConfigError, match=message):
            config(**extra)


def test_register_refuses_a_row_the_code_cannot_use(toy_method):
    row = methods.METHODS["toy"]
    with pytest.raises(ValueError, match="'toy' is already in the table"):
        methods.register("toy", row)
    with pytest.raises(ValueError, match="predictor 'tree' is not one of chain, heads, block"):
        methods.register("toy2", dataclasses.replace(row, predictor="tree"))
    with pytest.raises(ValueError, match="options must be a MethodOptions dataclass"):
        methods.register("toy2", dataclasses.replace(row, options=dict))
    assert "toy2" not in methods.METHODS


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
