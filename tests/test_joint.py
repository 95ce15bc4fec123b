"""Joint modes (Medusa-2, joint MTP): the target receives gradient, its perplexity is reported
before and after, checkpoints carry it and resume, and the exports carry it."""
import copy
import json

import pytest
import torch

from tests.conftest import make_conversations, run_module, tiny_overrides
from train.joint import keep_close_kl, lm_loss


def test_lm_loss_and_keep_close_kl_match_direct_computation():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 6, 8), torch.randn(11, 8)
    ids = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 1]])
    logits = hidden @ head.T
    terms = [-torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]] for b in range(2) for t in range(5) if mask[b, t + 1]]
    torch.testing.assert_close(lm_loss(hidden, head, ids, mask, chunk_rows=3), sum(terms) / len(terms))
    h0, head0 = torch.randn(2, 6, 8), torch.randn(11, 8)
    p, q = torch.softmax(h0 @ head0.T, -1), torch.softmax(logits, -1)
    kls = [(p[b, t] * (p[b, t].log() - q[b, t].log())).sum() for b in range(2) for t in range(6) if mask[b, t]]
    torch.testing.assert_close(keep_close_kl(hidden, h0, head, head0, mask, chunk_rows=5), sum(kls) / len(kls))
    assert keep_close_kl(hidden, hidden, head, head, mask).abs() < 1e-5  # no drift, no penalty


@pytest.mark.parametrize("recipe", ["configs/mtp-joint.yaml", "configs/medusa2.yaml"])
def test_joint_recipe_trains_the_target_and_reports_its_perplexity(chat_file, tmp_path, recipe):
    from export.load import load_export
    from train.config import load_config
    from train.run import run

    out = tmp_path / "run"
    overrides = tiny_overrides(chat_file, out, **{"trainer.max_steps": 3, "trainer.precision": "32-true",
                                                  "optim.target_lr": 1e-3})
    if "mtp" in recipe:
        overrides.append("drafter.draft_vocab_size=49152")
    other = tmp_path / "other.jsonl"  # a second held-out set: the price is reported on each
    other.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(40, seed=9)))
    overrides.append(f"eval.datasets=[{chat_file}, {other}]")
    summary = run(load_config(recipe, overrides))
    ppl = summary["target_perplexity"]
    assert ppl["before"] > 1 and ppl["after"] > 1 and ppl["before"] != ppl["after"]  # the target moved
    also = ppl["also"][str(other)]
    assert also["before"] > 1 and also["before"] != ppl["before"] and also["after"] != also["before"]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(k.startswith("target.model.layers.0.") for k in ckpt)
    meta = json.loads((out / "export" / "draftsmith.json").read_text())
    assert meta["target_perplexity"]["after"] == pytest.approx(ppl["after"])
    if "mtp" in recipe:  # one HF checkpoint: the trained target with its MTP layers
        from safetensors.torch import load_file

        keys = set(load_file(str(out / "export" / "model.safetensors")))
        assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.2.eh_proj.weight" in keys
    else:
        assert (out / "export" / "target" / "config.json").is_file()
    # round trip: the export carries the trained target and the trained drafter, bit for bit in
    # the export's dtype (the stitched MTP checkpoint keeps the target's own bf16)
    from safetensors.torch import load_file

    exported_target = load_file(str(out / "export" / ("model.safetensors" if "mtp" in recipe else "target/model.safetensors")))
    trained_layers = {k[len("target."):]: v for k, v in ckpt.items() if k.startswith("target.model.layers.")}
    assert trained_layers and all(torch.equal(exported_target[k], v.to(exported_target[k].dtype))
                                  for k, v in trained_layers.items())
    reloaded = load_export(out / "export")  # the stitched or side-by-side export reads back
    stored = next(v.dtype for v in load_file(str(out / "export" / "model.safetensors")).values() if v.is_floating_point())
    trained = copy.deepcopy(reloaded)  # the checkpoint's drafter, rounded as the export stores it
    trained.load_state_dict({k[len("drafter."):]: v.to(stored).to(v.dtype) if v.is_floating_point() else v
                             for k, v in ckpt.items() if k.startswith("drafter.")})
    hidden = torch.randn(1, 7, reloaded.config.hidden_size)
    ids = torch.randint(0, 1000, (1, 7))
    for a, b in zip(reloaded.unroll(ids, hidden, 3, greedy=True), trained.unroll(ids, hidden, 3, greedy=True)):
        torch.testing.assert_close(a, b)


def test_joint_resume_continues_from_the_trained_target(chat_file, tmp_path):
    from train.config import load_config
    from train.run import run

    out = tmp_path / "run"
    base = tiny_overrides(chat_file, out, **{"trainer.precision": "32-true", "optim.target_lr": 1e-3,
                                             "drafter.draft_vocab_size": 49152, "optim.schedule_steps": 4})
    run(load_config("configs/mtp-joint.yaml", base + ["trainer.max_steps=2"]))
    first = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    run(load_config("configs/mtp-joint.yaml", base + ["trainer.max_steps=4"]), resume=str(out / "checkpoints" / "last.ckpt"))
    second = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    key = "target.model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(first[key], second[key])  # training went on from the saved target


def test_joint_mode_for_a_method_without_it_is_a_config_error(chat_file, tmp_path):
    res = run_module("train.__main__", *tiny_overrides(chat_file, tmp_path), "objective.joint=true")
    assert res.returncode == 2 and "objective.joint" in res.stderr


@pytest.mark.parametrize("method", ["medusa", "mtp"])
def test_the_target_gets_gradient_in_joint_mode_and_none_when_frozen(tiny_target, method):
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.mtp import MTPConfig, MTPDrafter
    from models.target import Target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    batch = {"input_ids": torch.randint(0, 40000, (2, 16)), "loss_mask": torch.ones(2, 16, dtype=torch.long),
             "lengths": torch.tensor([16, 16])}
    for joint in (False, True):
        target = Target.load(tiny_target, [])
        hf = target.model.config
        d = MedusaDrafter(MedusaConfig.from_target(hf, hf.vocab_size, 2)) if method == "medusa" else \
            MTPDrafter(MTPConfig.from_target(hf, hf.vocab_size, 2))
        d.init_from_target(target.model, torch.zeros(hf.vocab_size, dtype=torch.long), torch.ones(hf.vocab_size, dtype=torch.bool))
        module = DrafterModule(target, d, ObjectiveConfig(joint=joint, keep_weight=1.0 if method == "medusa" else 0.0),
                               OptimConfig(), EvalConfig(k=2), 10)
        module.log = lambda *a, **k: None
        module.train()
        module.training_step(batch, 0).backward()
        layer_grad = target.model.model.layers[0].mlp.up_proj.weight.grad
        if joint:
            assert layer_grad is not None and layer_grad.abs().sum() > 0
            assert target.model.get_input_embeddings().weight.grad is None  # embedding and head stay
        else:
            assert all(p.grad is None for p in target.parameters())


@pytest.mark.parametrize("recipe", ["configs/medusa2.yaml", "configs/mtp-joint.yaml"])
def test_joint_recipes_run_one_step_through_the_cli(chat_file, tmp_path, recipe):
    out = tmp_path / "run"
    extra = ["drafter.draft_vocab_size=49152"] if "mtp" in recipe else []
    res = run_module("train.__main__", "--config", recipe, *tiny_overrides(chat_file, out),
                     "trainer.max_steps=1", "trainer.precision=32-true", *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "perplexity" in res.stdout
    from export.load import load_export

    load_export(out / "export")
