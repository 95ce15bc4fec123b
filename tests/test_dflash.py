"""DFlash: block masks (bidirectional inside, never other blocks, no peeking past the block),
the frozen target, predicted acceptance, the recipe and its layout."""
import json

import torch
from safetensors.torch import load_file

from models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from tests.conftest import overfit_one_batch, run_module, tiny_overrides


def tiny_dflash(B=4, seed=0):
    torch.manual_seed(seed)
    d = DFlashDrafter(DFlashConfig(vocab_size=300, draft_vocab_size=300, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_num_layers=6,
                                   mask_token_id=7, target_layer_ids=[1, 3], num_layers=2, block_size=B))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d.t2d.fill_(True)
    return d.eval()


def test_default_layers_are_evenly_spaced_output_ids():
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert all(0 <= i < 2 for i in default_target_layer_ids(2))


def test_a_block_sees_its_context_up_to_the_anchor_and_nothing_else():
    d = tiny_dflash()
    T = 14
    ids, feats = torch.randint(0, 300, (T,)), torch.randn(T, 64)
    anchors = torch.tensor([2, 6, 9])
    base = d.block_logits(ids, feats, anchors)
    # tokens after the anchor token x_{a+1} and features after a: invisible to that block
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[8:] = (ids[8:] + 1) % 300  # after x_7 = block 1's anchor token
    feats2[7:] += 1.0
    moved = d.block_logits(ids2, feats2, anchors)
    torch.testing.assert_close(base[:2], moved[:2])  # blocks anchored at 2 and 6
    assert not torch.allclose(base[2], moved[2])
    # blocks never see each other: dropping one block changes nothing for the others
    torch.testing.assert_close(d.block_logits(ids, feats, anchors[[0, 2]]), base[[0, 2]], rtol=1e-5, atol=1e-5)


def test_rows_batched_in_one_forward_equal_one_row_at_a_time():
    """Training runs every row's blocks in one forward: each row must see only its own
    context, exactly as alone."""
    d = tiny_dflash()
    T = 16
    ids, feats = torch.randint(0, 300, (3, T)), torch.randn(3, T, 64)
    anchors = torch.tensor([[1, 5, 9], [0, 3, 12], [7, 7, 7]])
    batched = d.block_logits(ids, feats, anchors)
    assert batched.shape == (3, 3, 4, 300)
    for r in range(3):
        torch.testing.assert_close(batched[r], d.block_logits(ids[r], feats[r], anchors[r]), rtol=1e-5, atol=1e-5)


def test_attention_inside_a_block_is_bidirectional():
    d = tiny_dflash()
    ids, feats = torch.randint(0, 300, (10,)), torch.randn(10, 64)
    anchors = torch.tensor([3])
    base = d.block_logits(ids, feats, anchors)
    d.config.mask_token_id = 8  # the later block positions' input changes
    moved = d.block_logits(ids, feats, anchors)
    assert not torch.allclose(base[0, 0], moved[0, 0])  # position 0 sees positions after it


def test_dflash_trains_and_leaves_the_frozen_target_alone(tiny_target):
    from models.target import Target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    hf_cfg = Target.load(tiny_target, []).model.config
    d = DFlashDrafter(DFlashConfig.from_target(hf_cfg, hf_cfg.vocab_size, 0, num_layers=1, block_size=4))
    target = Target.load(tiny_target, d.aux_layer_ids)
    d.init_from_target(target.model, torch.zeros(hf_cfg.vocab_size, dtype=torch.long), torch.ones(hf_cfg.vocab_size, dtype=torch.bool))
    module = DrafterModule(target, d, ObjectiveConfig(block_anchors=8), OptimConfig(), EvalConfig(k=3, anchors_per_sequence=4), 100)
    batch, losses = overfit_one_batch(module, d, 30, length=24, reseed=1)  # the same anchors each step
    assert all(p.grad is None for p in target.parameters()) and d.lm_head.weight.grad is None
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    hist = module.predicted_histogram(batch["input_ids"], batch["loss_mask"], batch["lengths"],
                                      d.features(target(batch["input_ids"])), None)
    assert int(hist.sum()) == 8  # 4 anchors per row, 2 rows


def test_dflash_recipe_cli_layout_and_check(chat_file, tmp_path):
    from export.check import run_checks
    from export.load import load_export

    out = tmp_path / "run"
    res = run_module("train.__main__", "--config", "configs/dflash.yaml",
                     *tiny_overrides(chat_file, out, **{"trainer.max_steps": 2, "drafter.draft_vocab_size": 49152}),
                     "trainer.precision=32-true", "drafter.dflash.layers=2", "drafter.dflash.block_size=4")
    assert res.returncode == 0, res.stderr[-3000:]
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [0, 1]  # the default, de-duplicated on a 2-layer target
    keys = set(load_file(str(export / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    assert isinstance(load_export(export), DFlashDrafter)
    checks = run_checks(export)
    assert all(c.ok for c in checks), [c.line() for c in checks]

    # vLLM's speculators layout of the same run (a full vocabulary here: no head, no maps stored)
    spec = tmp_path / "spec"
    res = run_module("export.__main__", "--checkpoint", str(out), "--format", "speculators",
                     "--out", str(spec), "--dtype", "float32")
    assert res.returncode == 0, res.stderr[-3000:]
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in json.loads((export / "draftsmith.json").read_text())
                                                    ["drafter_config"]["target_layer_ids"]]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2 and config["sample_from_anchor"] is False
    keys = set(load_file(str(spec / "model.safetensors")))
    assert not any(k.startswith(("embed_tokens", "lm_head", "d2t", "t2d")) for k in keys)
    assert all(c.ok for c in run_checks(spec)), [c.line() for c in run_checks(spec)]
    a, b = load_export(export), load_export(spec)
    ids, feats = torch.randint(0, a.config.vocab_size, (12,)), torch.randn(12, a.config.hidden_size * len(a.aux_layer_ids))
    anchors = torch.tensor([0, 4, 7])
    with torch.no_grad():
        assert torch.equal(a.draft_at(ids, feats, anchors, 3), b.draft_at(ids, feats, anchors, 3))
    # a speculators folder made elsewhere (no draftsmith.json): read from config.json alone
    (spec / "draftsmith.json").unlink()
    c = load_export(spec)
    assert c.config.target_layer_ids == b.config.target_layer_ids and c.config.mask_token_id == b.config.mask_token_id
    with torch.no_grad():
        assert torch.equal(c.draft_at(ids, feats, anchors, 3), b.draft_at(ids, feats, anchors, 3))


def test_eval_k_beyond_the_block_is_a_config_error(chat_file, tmp_path):
    res = run_module("train.__main__", "--config", "configs/dflash.yaml", *tiny_overrides(chat_file, tmp_path),
                     "drafter.dflash.block_size=4", "eval.k=4")
    assert res.returncode == 2 and "eval.k" in res.stderr and "Traceback" not in res.stderr


def test_default_mask_token_is_a_special_token_chat_text_never_uses(tokenizer):
    from train.run import default_mask_token

    mask = default_mask_token(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                             tokenize=True)
    assert mask not in rendered and mask not in (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id)
    assert tokenizer.added_tokens_decoder[mask].special
