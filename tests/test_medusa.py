"""Medusa: shapes, alignment, the frozen target, the CLI recipe and its export round trip."""
import json

import pytest
import torch

from models.medusa import MedusaConfig, MedusaDrafter
from tests.conftest import overfit_one_batch, run_module, tiny_overrides


def tiny_medusa(heads=3, layers=1, V=300, Vd=64, H=32, seed=0):
    torch.manual_seed(seed)
    d = MedusaDrafter(MedusaConfig(vocab_size=V, draft_vocab_size=Vd, hidden_size=H, target_num_layers=2,
                                   num_heads=heads, num_layers=layers))
    ids = torch.randperm(V)[:Vd].sort().values
    d.d2t.copy_(ids - torch.arange(Vd))
    d.t2d.zero_()
    d.t2d[ids] = True
    for head in d.lm_heads:
        torch.nn.init.normal_(head.weight)
    return d


def test_heads_shapes_and_a_fresh_drafter_is_the_targets_head():
    d = tiny_medusa()
    hidden = torch.randn(2, 5, 32)
    logits = d.unroll(torch.zeros(2, 5, dtype=torch.long), hidden, 3)
    assert len(logits) == 3 and all(x.shape == (2, 5, 64) for x in logits)
    # zero-initialised residual blocks: each head is exactly its linear head on h_t
    for s in range(3):
        torch.testing.assert_close(logits[s], hidden @ d.lm_heads[s].weight.T)
    with pytest.raises(ValueError, match="needs 4 Medusa heads"):
        d.unroll(None, hidden, 4)


def test_heads_read_no_tokens_and_no_future_position():
    """Head s at position t sees only h_t: changing h at t+1 or any token changes nothing at t."""
    d = tiny_medusa()
    for block in d.blocks:
        for layer in block.layers:
            torch.nn.init.normal_(layer.weight, std=0.1)
    hidden = torch.randn(1, 6, 32)
    base = d.unroll(torch.zeros(1, 6, dtype=torch.long), hidden, 3)
    changed = hidden.clone()
    changed[:, 4:] += 1.0
    other = d.unroll(torch.ones(1, 6, dtype=torch.long), changed, 3)
    for a, b in zip(base, other):
        torch.testing.assert_close(a[:, :4], b[:, :4])
        assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_medusa_recipe_cli_one_step_and_export_round_trip(chat_file, tmp_path):
    from export.medusa import load_medusa

    out = tmp_path / "run"
    res = run_module("train.__main__", "--config", "configs/medusa1.yaml",
                     *tiny_overrides(chat_file, out), "trainer.max_steps=1", "trainer.precision=32-true")
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["medusa_fc_bias"] is True
    assert config["num_heads"] == 4 and config["truncated_vocab_size"] == 256
    reloaded = load_medusa(out / "export")
    assert torch.equal(reloaded.draft_ids()[:5], reloaded.draft_ids().sort().values[:5])
    hidden = torch.randn(1, 7, reloaded.config.hidden_size)
    # reload → export again → reload: same outputs for the same inputs
    from export.medusa import export_medusa

    export_medusa(reloaded, tmp_path / "again", target_name="tiny-random-llama", dtype=torch.float32, runtime_only=True)
    again = load_medusa(tmp_path / "again")
    for a, b in zip(reloaded.unroll(None, hidden, 4), again.unroll(None, hidden, 4)):
        torch.testing.assert_close(a, b)
    assert torch.equal(reloaded.draft_ids(), again.draft_ids())


def test_medusa_module_step_trains_heads_and_leaves_the_frozen_target_alone(tiny_target):
    """Through the shared LightningModule: gradients reach the heads, never the target, and
    the loss falls when one batch is overfitted."""
    from models.target import Target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    target = Target.load("tiny-random-llama", [])
    hf = target.model.config
    d = MedusaDrafter(MedusaConfig.from_target(hf, hf.vocab_size, num_heads=3))
    d.init_from_target(target.model, torch.zeros(hf.vocab_size, dtype=torch.long), torch.ones(hf.vocab_size, dtype=torch.bool))
    module = DrafterModule(target, d, ObjectiveConfig(ttt_steps=7), OptimConfig(), EvalConfig(k=3), 100)
    assert module.steps == 3  # every head, whatever ttt_steps says
    before = {n: p.clone() for n, p in target.named_parameters()}
    _, losses = overfit_one_batch(module, d, 30, length=24, vocab=hf.vocab_size)
    assert all(p.grad is None for p in target.parameters())
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())
    assert d.blocks[0].layers[0].weight.abs().sum() > 0  # the zero-initialised blocks moved
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_eval_k_beyond_the_heads_is_a_config_error(chat_file, tmp_path):
    res = run_module("train.__main__", "--config", "configs/medusa1.yaml",
                     *tiny_overrides(chat_file, tmp_path), "eval.k=6")
    assert res.returncode == 2 and "eval.k" in res.stderr and "Traceback" not in res.stderr


def _medusa_for(tiny_target, seed=0):
    from models.target import Target

    target = Target.load(tiny_target, [])
    hf = target.model.config
    torch.manual_seed(seed)
    d = MedusaDrafter(MedusaConfig.from_target(hf, 512, num_heads=3))
    ids = torch.randperm(hf.vocab_size)[:512].sort().values
    d.init_from_target(target.model, ids - torch.arange(512), torch.zeros(hf.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    for block in d.blocks:
        for layer in block.layers:
            torch.nn.init.normal_(layer.weight, std=0.05)
    return target, d.eval()


def test_runtime_medusa_drafts_what_training_predicts_and_is_lossless(tiny_target):
    from inference.runtime.engine import generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import MedusaProposer

    target, d = _medusa_for(tiny_target)
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (7, 3, 12)]
    # the first proposal after prefill: heads on the target's final hidden state at the last prompt token
    proposer = MedusaProposer(d, 3, rt.config)
    with torch.no_grad():
        logits, aux = rt(torch.tensor([prompts[0]]), torch.arange(7)[None], rt.new_cache(1, 16), proposer.aux_layers,
                         logits_at=torch.tensor([6]))
        proposer.begin([prompts[0]], aux, None)
        hidden = target(torch.tensor([prompts[0]])).last_hidden[:, -1:]
        expected = [d.draft_ids()[x[0, 0].argmax()].item() for x in d.unroll(None, hidden, 3)]
    assert proposer.propose([prompts[0]]) == [expected]
    plain, _ = generate(rt, prompts, 24)
    spec, stats = generate(rt, prompts, 24, proposer=MedusaProposer(d, 3, rt.config))
    assert spec == plain and sum(stats.histogram) > 0


def test_medusa_proposer_refuses_a_foreign_target_or_too_many_drafts(tiny_target):
    from types import SimpleNamespace

    from inference.proposers import MedusaProposer

    _, d = _medusa_for(tiny_target)
    other = SimpleNamespace(vocab_size=d.config.vocab_size + 1, hidden_size=d.config.hidden_size, num_layers=2)
    with pytest.raises(ValueError, match="another target"):
        MedusaProposer(d, 2, other)
    same = SimpleNamespace(vocab_size=d.config.vocab_size, hidden_size=d.config.hidden_size, num_layers=2)
    with pytest.raises(ValueError, match="3 heads"):
        MedusaProposer(d, 4, same)
