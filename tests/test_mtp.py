"""MTP: what each module may see, greedy chains that never peek, the recipe and its layout."""
import json

import pytest
import torch
from safetensors.torch import load_file

from models.mtp import MTPConfig, MTPDrafter
from tests.conftest import overfit_one_batch, run_module, tiny_overrides


def tiny_mtp(D=3, V=300, seed=0):
    torch.manual_seed(seed)
    d = MTPDrafter(MTPConfig(vocab_size=V, draft_vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, target_num_layers=2, num_modules=D))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return d.eval()


def test_module_d_sees_only_tokens_up_to_t_plus_d():
    d = tiny_mtp()
    T = 12
    ids, feats = torch.randint(0, 300, (1, T)), torch.randn(1, T, 32)
    base = d.unroll(ids, feats, 3)
    for j in range(2, T):  # change token x_j: step s at index t reads x_{t+1+s}, so t >= j-1-s may move
        other = ids.clone()
        other[0, j] = (ids[0, j] + 1) % 300
        moved = d.unroll(other, feats, 3)
        for s in range(3):
            safe = max(j - 1 - s, 0)
            torch.testing.assert_close(base[s][:, :safe], moved[s][:, :safe])
            if j - 1 - s >= 0 and j - 1 - s < T - 2 - s:
                assert not torch.allclose(base[s][:, j - 1 - s], moved[s][:, j - 1 - s])


def test_greedy_chain_never_peeks_beyond_the_bonus_token():
    """The chain at index t may read x_0..x_{t+1} (x_{t+1} is the verified bonus), nothing after."""
    d = tiny_mtp()
    T, t = 12, 5
    ids, feats = torch.randint(0, 300, (1, T)), torch.randn(1, T, 32)
    base = d.unroll(ids, feats, 3, greedy=True)
    other = ids.clone()
    other[0, t + 2 :] = torch.randint(0, 300, (T - t - 2,))
    feats2 = feats.clone()
    feats2[:, t + 1 :] += 1.0
    moved = d.unroll(other, feats2, 3, greedy=True)
    for s in range(3):
        torch.testing.assert_close(base[s][:, : t + 1], moved[s][:, : t + 1])
    # step 0 of the chain is the teacher-forced module 1
    torch.testing.assert_close(base[0], d.unroll(ids, feats, 1)[0])


def test_mtp_trains_modules_and_not_the_frozen_target(tiny_target):
    from models.target import Target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    target = Target.load(tiny_target, [])
    hf = target.model.config
    d = MTPDrafter(MTPConfig.from_target(hf, hf.vocab_size, 2))
    d.init_from_target(target.model, torch.zeros(hf.vocab_size, dtype=torch.long), torch.ones(hf.vocab_size, dtype=torch.bool))
    module = DrafterModule(target, d, ObjectiveConfig(ttt_steps=7, ttt_decay=1.0), OptimConfig(), EvalConfig(k=2), 100)
    assert module.steps == 2
    _, losses = overfit_one_batch(module, d, 30)
    assert all(p.grad is None for p in target.parameters())
    assert d.lm_head.weight.grad is None and d.mtp[1].eh_proj.weight.grad is not None
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_mtp_recipe_cli_and_deepseek_layout_round_trip(chat_file, tmp_path):
    from export.load import load_export

    out = tmp_path / "run"
    res = run_module("train.__main__", "--config", "configs/mtp.yaml", *tiny_overrides(chat_file, out),
                     "trainer.max_steps=1", "trainer.precision=32-true", "drafter.draft_vocab_size=49152")
    assert res.returncode == 0, res.stderr[-3000:]
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 3 and config["num_hidden_layers"] == 2
    keys = set(load_file(str(export / "model.safetensors")))
    for d in range(3):
        for part in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight"):
            assert f"model.layers.{2 + d}.{part}" in keys
    reloaded = load_export(export)
    assert isinstance(reloaded, MTPDrafter)
    from export.mtp import export_mtp

    export_mtp(reloaded, tmp_path / "again", target_name="tiny-random-llama", target_config=config,
               embed=reloaded.embed_tokens.weight, head=reloaded.lm_head.weight, dtype=torch.float32)
    again = load_export(tmp_path / "again")
    ids, feats = torch.randint(0, 1000, (1, 9)), torch.randn(1, 9, reloaded.config.hidden_size)
    for a, b in zip(reloaded.unroll(ids, feats, 3, greedy=True), again.unroll(ids, feats, 3, greedy=True)):
        torch.testing.assert_close(a, b)


def test_eval_k_beyond_the_modules_is_a_config_error(chat_file, tmp_path):
    res = run_module("train.__main__", "--config", "configs/mtp.yaml", *tiny_overrides(chat_file, tmp_path),
                     "eval.k=4")
    assert res.returncode == 2 and "eval.k" in res.stderr and "MTP modules" in res.stderr


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_runtime_recompute_proposer_drafts_what_training_predicts_and_is_lossless(tiny_target, kind):
    from inference.runtime.engine import cache_size, generate
    from inference.runtime.model import RuntimeModel
    from inference.proposers import drafter_proposer
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.target import Target
    from tests.test_eagle3_runtime import Recording

    hf_target = Target.load(tiny_target, [])
    hf = hf_target.model.config
    torch.manual_seed(0)
    if kind == "mtp":
        d = MTPDrafter(MTPConfig.from_target(hf, hf.vocab_size, 3))
    else:
        d = DFlashDrafter(DFlashConfig.from_target(hf, hf.vocab_size, 0, num_layers=1, block_size=4, target_layer_ids=[0, 1]))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.1)
    d.init_from_target(hf_target.model, torch.zeros(hf.vocab_size, dtype=torch.long), torch.ones(hf.vocab_size, dtype=torch.bool))
    d.eval()
    target = Target(hf_target.model, d.aux_layer_ids)
    rt = RuntimeModel.from_pretrained(tiny_target)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (5, 9)]
    rec = Recording(drafter_proposer(d, 3, 2, cache_size(prompts, 12, 3), rt.config))
    spec, _ = generate(rt, prompts, 12, proposer=rec)
    assert spec == generate(rt, prompts, 12)[0]
    checked = 0
    for contexts, drafts in rec.calls:
        for ctx, got in zip(contexts, drafts):
            ids = torch.tensor([ctx])
            with torch.no_grad():
                out = target(ids)
                feats = d.features(out)
                a = len(ctx) - 2
                if kind == "dflash":
                    want = d.draft_at(ids[0], feats[0], torch.tensor([a]), 3)[0].tolist()
                else:
                    want = [int(d.draft_ids()[s[0, a].argmax()]) for s in d.unroll(ids, feats, 3, greedy=True)]
            assert got == want
            checked += 1
    assert checked >= 6
