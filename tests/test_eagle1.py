"""EAGLE-1: layout, feature regression, the runtime drafting what training predicts, recipe."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from inference.proposers import Eagle3Proposer
from models.eagle1 import Eagle1Config, Eagle1Drafter
from models.target import Target
from tests.conftest import overfit_one_batch, run_module, tiny_overrides
from tests.test_eagle3_runtime import Recording
from train.losses import feature_smooth_l1, hard_ce


def _eagle1_for(hf_model, vd=512, seed=0):
    torch.manual_seed(seed)
    d = Eagle1Drafter(Eagle1Config.from_target(hf_model.config, vd))
    for name, p in d.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.sort(torch.randperm(d.config.vocab_size)[:vd]).values
    d.init_from_target(hf_model, ids - torch.arange(vd), torch.zeros(d.config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    return d.eval()


def test_runtime_eagle1_drafts_equal_the_training_unroll_and_stay_lossless(tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _eagle1_for(hf)
    target = Target(hf, [])
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)]
    k = 4
    rec = Recording(Eagle3Proposer(drafter, k, batch=3, max_len=cache_size(prompts, 16, k), target_config=rt.config))
    spec, _ = generate(rt, prompts, 16, proposer=rec)
    assert spec == generate(rt, prompts, 16)[0]
    checked = 0
    for contexts, drafts in rec.calls:
        for ctx, d in zip(contexts, drafts):
            ids = torch.tensor([ctx])
            with torch.no_grad():
                steps = drafter.unroll(ids, target(ids).last_hidden, k, greedy=True)
            a = len(ctx) - 2
            assert d == [int(drafter.draft_ids()[s[0, a].argmax()]) for s in steps]
            checked += 1
    assert checked >= 10


def test_no_step_sees_a_future_position():
    cfg = Eagle1Config(vocab_size=300, draft_vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, target_num_layers=2)
    torch.manual_seed(0)
    d = Eagle1Drafter(cfg)
    ids, feats = torch.randint(0, 300, (1, 10)), torch.randn(1, 10, 32)
    base = d.unroll(ids, feats, 3)
    feats2 = feats.clone()
    feats2[:, 6:] += 1
    ids2 = ids.clone()
    ids2[:, 9] = (ids[:, 9] + 1) % 300  # x_9 is read by step s at index 8 - s only
    other = d.unroll(ids2, feats2, 3)
    for s, (a, b) in enumerate(zip(base, other)):
        limit = min(6, 8 - s)
        torch.testing.assert_close(a[:, :limit], b[:, :limit])


def test_feature_and_hard_label_losses_match_direct_computation():
    torch.manual_seed(0)
    pred, tgt = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]]).bool()
    direct = sum(torch.nn.functional.smooth_l1_loss(pred[b, t], tgt[b, t], reduction="mean") for b in range(2) for t in range(5) if mask[b, t]) / mask.sum()
    torch.testing.assert_close(feature_smooth_l1(pred, tgt, mask), direct)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, 2] = -1  # a token outside the draft vocabulary: not counted
    keep = mask & (labels >= 0)
    direct = sum(-torch.log_softmax(logits[b, t], -1)[labels[b, t]] for b in range(2) for t in range(5) if keep[b, t]) / keep.sum()
    torch.testing.assert_close(hard_ce(logits, labels, mask), direct)


def test_eagle1_recipe_cli_and_export_layout_round_trip(chat_file, tmp_path):
    from export.eagle1 import export_eagle1, load_eagle1

    out = tmp_path / "run"
    res = run_module("train.__main__", "--config", "configs/eagle1.yaml", *tiny_overrides(chat_file, out),
                     "trainer.max_steps=1", "trainer.precision=32-true", "drafter.draft_vocab_size=49152")
    assert res.returncode == 0, res.stderr[-3000:]
    export = out / "export"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    keys = set(load_file(str(export / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any(k.startswith(("lm_head", "norm", "layers.0.input_layernorm")) for k in keys) and "d2t" not in keys
    reloaded = load_eagle1(export)
    export_eagle1(reloaded, tmp_path / "again", target_name="tiny-random-llama", dtype=torch.float32)
    again = load_eagle1(tmp_path / "again")
    ids, feats = torch.randint(0, 1000, (1, 9)), torch.randn(1, 9, reloaded.config.hidden_size)
    for a, b in zip(reloaded.unroll(ids, feats, 3, greedy=True), again.unroll(ids, feats, 3, greedy=True)):
        torch.testing.assert_close(a, b)
    from models.zoo import resolve_target

    hf = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-random-llama"))
    torch.testing.assert_close(reloaded.lm_head.weight, hf.get_output_embeddings().weight.detach())  # the target's head


def test_feature_regression_trains_through_the_module(tiny_target):
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    target = Target.load(tiny_target, [])
    d = _eagle1_for(target.model, vd=target.model.config.vocab_size).train()
    module = DrafterModule(target, d, ObjectiveConfig(ttt_steps=2, token_weight=0.1, feature_weight=1.0), OptimConfig(),
                           EvalConfig(k=3), 100)
    _, losses = overfit_one_batch(module, d, 40)
    assert d.lm_head.weight.grad is None and d.embed_tokens.weight.grad is None  # the target's, frozen
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_feature_weight_on_another_method_is_a_config_error(chat_file, tmp_path):
    res = run_module("train.__main__", *tiny_overrides(chat_file, tmp_path), "objective.feature_weight=1.0")
    assert res.returncode == 2 and "objective.feature_weight" in res.stderr and "Traceback" not in res.stderr
