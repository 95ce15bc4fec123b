"""DSpark: the Markov head's bias in vLLM's layout, teacher forcing, the left-to-right walk the
promise and the runtime draft with, the confidence head's objective, checkpoints and the recipe."""
import pytest
import torch

from models.dspark import DSparkConfig, DSparkDrafter, survival
from tests.conftest import run_module, tiny_overrides

V, H, R = 300, 32, 8


def tiny_dspark(B=5, seed=0, **heads):
    torch.manual_seed(seed)
    d = DSparkDrafter(DSparkConfig(vocab_size=V, draft_vocab_size=V, hidden_size=H, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_num_layers=6,
                                   mask_token_id=7, target_layer_ids=[1, 3], num_layers=2, block_size=B,
                                   markov_rank=R, **heads))
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d.t2d.fill_(True)
    return d.eval()


def text(T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (T,), generator=g), torch.randn(T, 2 * H, generator=g)


def test_parameters_are_named_and_shaped_as_vllm_loads_them():
    d = tiny_dspark()
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items() if k.startswith(("markov", "confidence"))}
    assert shapes == {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
                      "confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
    assert "confidence_head.proj.weight" not in tiny_dspark(confidence_head=False).state_dict()
    assert tiny_dspark(confidence_with_markov=False).confidence_head.proj.weight.shape == (1, H)
    fresh = DSparkDrafter(tiny_dspark().config)
    assert not fresh.markov_head.markov_w2.weight.any()  # a new drafter drafts as its DFlash backbone


def test_the_markov_bias_is_w2_of_w1_of_the_previous_text_token():
    d = tiny_dspark()
    ids, feats = text()
    anchors = torch.tensor([1, 5, 9])
    with torch.no_grad():
        biased = d.block_logits(ids, feats, anchors)  # [m,B,Vd]
        base = d.lm_head(d.block_hidden(ids, feats, anchors))
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight  # [V,r], [Vd,r]
        for i, a in enumerate(anchors.tolist()):
            for j in range(1, d.config.block_size):
                prev = ids[a + j]  # x_{a+1} (the bonus) for j = 1, the text's token before x_{a+1+j} after
                torch.testing.assert_close(biased[i, j] - base[i, j], w2 @ w1[prev], rtol=1e-5, atol=1e-5)


def test_teacher_forcing_reads_only_the_token_before_each_position():
    d = tiny_dspark()
    ids, feats = text()
    anchors = torch.tensor([3])  # block at positions 4..8; position j's previous token is x_{3+j}
    with torch.no_grad():
        logits, conf = d.block_outputs(ids, feats, anchors)
        moved_ids = ids.clone()
        moved_ids[6] = (ids[6] + 1) % V  # x_6: the previous token of position 3 only
        moved, moved_conf = d.block_outputs(moved_ids, feats, anchors)
    changed = [not torch.allclose(logits[0, j], moved[0, j]) for j in range(d.config.block_size)]
    assert changed == [False, False, False, True, False]
    assert [bool(c) for c in (conf[0] != moved_conf[0])] == changed


def test_the_greedy_walk_is_step_by_step_argmax_of_base_plus_bias_of_the_draft_before():
    d = tiny_dspark()
    ids, feats = text()
    anchors, k = torch.tensor([0, 4, 8, 11]), 4
    with torch.no_grad():
        tokens, conf = d.draft_block(ids, feats, anchors, k)
        hidden = d.block_hidden(ids, feats, anchors)
        prev = ids[anchors + 1]
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        expect, expect_conf = [], []
        for j in range(1, k + 1):
            logits = d.lm_head(hidden[:, j]) + w1[prev] @ w2.T
            expect_conf.append(torch.sigmoid(torch.cat([hidden[:, j], w1[prev]], -1) @ d.confidence_head.proj.weight[0]
                                             + d.confidence_head.proj.bias))
            prev = d.draft_ids()[logits.argmax(-1)]
            expect.append(prev)
        assert torch.equal(tokens, torch.stack(expect, 1))
        torch.testing.assert_close(conf, torch.stack(expect_conf, 1), rtol=1e-5, atol=1e-6)
        assert torch.equal(d.draft_at(ids, feats, anchors, k), tokens)
        # the walk's drafts are what teacher forcing on a text that continues with them argmaxes
        for i, a in enumerate(anchors.tolist()):
            forced = ids.clone()
            n = min(k, len(ids) - a - 2)
            forced[a + 2 : a + 2 + n] = tokens[i, :n]
            logits = d.block_logits(forced, feats, anchors[i : i + 1])[0, 1 : n + 1]
            assert torch.equal(d.draft_ids()[logits.argmax(-1)], tokens[i, :n])
    assert torch.equal(survival(conf), conf.cumprod(1)) and bool((survival(conf)[:, 1:] <= conf[:, :-1]).all())


def test_the_sampled_walk_feeds_each_drawn_token_to_the_next_bias():
    from inference.walks.sampled import drive_drafter

    d = tiny_dspark()
    ids, feats = text()
    anchors = torch.tensor([2, 7])
    seen, drawn = [], []
    g = torch.Generator().manual_seed(0)

    def step(logits):
        seen.append(logits.clone())
        drawn.append(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0])
        return drawn[-1]

    with torch.no_grad():
        drive_drafter(d, ids, feats, anchors, 3, step)  # the promise's sampled walk
        base = d.lm_head(d.block_hidden(ids, feats, anchors))
        bias = d.markov_head.bias
        w1 = d.markov_head.markov_w1
        for j, prev in enumerate([ids[anchors + 1]] + drawn[:-1]):
            torch.testing.assert_close(seen[j], base[:, j + 1] + bias(w1(prev)), rtol=1e-5, atol=1e-5)


def test_the_confidence_objective_learns_acceptance():
    from train.losses import acceptance_targets, confidence_bce

    torch.manual_seed(0)
    q, p = torch.randn(64, 20), torch.softmax(torch.randn(64, 20), -1)
    overlap = acceptance_targets(q, p, p.argmax(-1), torch.arange(20), "overlap")
    torch.testing.assert_close(overlap, torch.minimum(torch.softmax(q, -1), p).sum(-1))
    greedy = acceptance_targets(q, p, p.argmax(-1), torch.arange(20), "greedy")
    assert torch.equal(greedy, (q.argmax(-1) == p.argmax(-1)).float())
    # a linear head on features that say how well the draft matched learns it (BCE falls)
    head = torch.nn.Linear(2, 1)
    x = torch.stack([overlap, torch.randn(64)], 1)
    opt = torch.optim.SGD(head.parameters(), lr=2.0)
    mask = torch.ones(64, dtype=torch.bool)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = confidence_bce(head(x)[:, 0], overlap, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses[::20]


@pytest.fixture(scope="module")
def trained_setup(tiny_target):
    """A DSpark drafter (block 4, rank 8) on the tiny target, in a DrafterModule."""
    from models.target import Target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    hf_cfg = Target.load(tiny_target, []).model.config
    torch.manual_seed(0)
    d = DSparkDrafter(DSparkConfig.from_target(hf_cfg, hf_cfg.vocab_size, 0, num_layers=1, block_size=4, markov_rank=8))
    target = Target.load(tiny_target, d.aux_layer_ids)
    d.init_from_target(target.model, torch.zeros(hf_cfg.vocab_size, dtype=torch.long),
                       torch.ones(hf_cfg.vocab_size, dtype=torch.bool))
    module = DrafterModule(target, d, ObjectiveConfig(block_anchors=6), OptimConfig(), EvalConfig(k=3), 100)
    module.log = lambda *a, **k: None
    ids = torch.randint(0, hf_cfg.vocab_size, (2, 20))
    return target, d, module, ids


def test_training_step_adds_the_weighted_confidence_bce_and_reaches_every_head(trained_setup):
    target, d, module, ids = trained_setup
    mask = torch.ones(2, 20, dtype=torch.long)

    def losses(weight):
        d.config.confidence_weight = weight
        torch.manual_seed(3)  # the same anchors
        out, teacher, greedy = module._target_pass(ids)
        return module._objective(ids, mask, out, teacher, greedy)[1]

    with_conf, without = losses(1.0), losses(0.0)
    assert all(a > b for a, b in zip(with_conf, without))  # each position's loss carries its BCE (> 0)
    d.config.confidence_weight = 1.0
    total = module.training_step({"input_ids": ids, "loss_mask": mask}, 0)
    total.backward()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"):
        assert dict(d.named_parameters())[name].grad.abs().sum() > 0, name
    assert d.lm_head.weight.grad is None and all(p.grad is None for p in target.parameters())
    d.zero_grad(set_to_none=True)


def test_the_promise_walks_draft_with_the_markov_walk_with_and_without_adaptive_verification(trained_setup):
    from inference.runtime.adaptive import choose_width
    from inference.walks.greedy import chain_widths, predicted_histogram
    from inference.walks.sampled import sampled_chain_histograms, sampled_histogram

    target, d, module, ids = trained_setup
    with torch.no_grad():
        torch.nn.init.normal_(d.markov_head.markov_w2.weight, std=0.5)  # a bias that matters
        mask, lengths = torch.ones(2, 20, dtype=torch.long), torch.tensor([20, 20])
        out = target(ids)
        feats = d.features(out)
        _, greedy = target.head_outputs(out.last_hidden)
        walk = dict(target=target, drafter=d, ids=ids, loss_mask=mask, lengths=lengths, k=3, anchors_per_sequence=6,
                    features=feats, greedy=greedy)
        plain = predicted_histogram(**walk)
        assert torch.equal(predicted_histogram(**walk, verify_width=lambda c: torch.full((c.shape[0],), 3)), plain)
        one = predicted_histogram(**walk, verify_width=lambda c: torch.ones(c.shape[0], dtype=torch.long))
        assert one[2:].sum() == 0 and one.sum() >= plain.sum()  # one draft verified per chain: more, shorter chains

        # the width a chain verifies is the runtime's choice for that chain alone (batch 1)
        step_ms = torch.tensor([1.0, 1.2, 1.25, 2.5])
        conf = torch.rand(32, 3, generator=torch.Generator().manual_seed(0))
        got = chain_widths(step_ms)(conf)
        assert got.tolist() == [int(choose_width(c[None], torch.ones(1, dtype=torch.bool), step_ms)) for c in conf]
        assert len(set(got.tolist())) > 1

        anchors = torch.tensor([1, 5, 9, 12])
        args = (target, d, ids[0], feats[0], out.last_hidden[0], anchors, 3, 1.0)
        ones = lambda c: torch.ones(c.shape[0], dtype=torch.long)  # noqa: E731
        for verification in ("standard", "block"):
            full = sampled_chain_histograms(*args, verification, torch.Generator().manual_seed(5))
            same = sampled_chain_histograms(*args, verification, torch.Generator().manual_seed(5),
                                            verify_width=lambda c: torch.full((c.shape[0],), 3))
            if verification == "block":  # both draw the chain from q, as served
                torch.testing.assert_close(full, same)
            cut = sampled_chain_histograms(*args, verification, torch.Generator().manual_seed(5), verify_width=ones)
            assert cut[:, 2:].abs().sum() == 0 and torch.allclose(cut.sum(1), torch.ones(4, dtype=torch.float64))
        # the held-out walk at T = 1 drafts with the Markov walk too
        hist = sampled_histogram(target, d, ids, mask, lengths, 3, 4, 1.0, "block", torch.Generator().manual_seed(0),
                                 features=feats, last_hidden=out.last_hidden)
        chains = float(hist.sum())  # each chain adds its expected histogram, a row summing to 1
        assert hist.shape == (4,) and 0 < chains <= 8 and abs(chains - round(chains)) < 1e-6, hist


def test_config_round_trips_through_a_checkpoint_and_the_run_config():
    from models.checkpoint import drafter_from_checkpoint
    from models.methods import method_name_of
    from train.config import config_from_dict

    d = tiny_dspark(confidence_target="greedy", confidence_weight=0.5)
    assert method_name_of(d) == "dspark"
    section = {"version": 1, "method": "dspark", "drafter_config": d.config.to_dict(), "run_config": {},
               "draft_vocab": {"d2t": d.d2t, "t2d": d.t2d},
               "target": {"name": "t", "weights_sha256": None, "config": {}}}
    back, _ = drafter_from_checkpoint({"draftsmith": section, "state_dict": {f"drafter.{k}": v for k, v in d.state_dict().items()}})
    assert type(back) is DSparkDrafter and back.config == d.config
    ids, feats = text()
    with torch.no_grad():
        assert torch.equal(back.draft_at(ids, feats, torch.tensor([2, 6]), 3), d.draft_at(ids, feats, torch.tensor([2, 6]), 3))
    cfg = config_from_dict({"drafter": {"method": "dspark", "dspark": {"markov_rank": 64, "confidence_target": "greedy"}},
                            "trainer": {"max_steps": 1}}, [])
    assert cfg.drafter.options.markov_rank == 64 and cfg.to_dict()["drafter"]["dspark"]["confidence_target"] == "greedy"


def test_bad_dspark_settings_are_config_errors(chat_file, tmp_path):
    def refused(config, *overrides):
        res = run_module("train.__main__", "--config", config, *tiny_overrides(chat_file, tmp_path), *overrides)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
        return res.stderr

    assert "drafter.dspark.markov_rank: must be a positive integer, got 0" in refused(
        "configs/dspark.yaml", "drafter.dspark.markov_rank=0", "drafter.dspark.confidence_target=sometimes")
    assert "eval.step_costs: " in refused("configs/dspark.yaml", f"eval.step_costs={tmp_path / 'none.json'}")
    costs = write_step_costs(tmp_path / "costs.json", k=3)
    assert "reads a confidence head, which this dflash drafter has not" in refused(
        "configs/dflash.yaml", f"eval.step_costs={costs}", "drafter.dflash.block_size=4")
    assert "confidence head" in refused("configs/dspark.yaml", f"eval.step_costs={costs}",
                                        "drafter.dspark.confidence_head=false")


def write_step_costs(path, k: int):
    from inference.runtime.adaptive import StepCosts

    # verifying a third draft costs more than it can bring: the widths differ by chain
    StepCosts(target="tiny-random-llama", device="cpu", dtype="float32",
              verify_ms={"1": [1.0, 1.1, 1.2, 3.0][: k + 1] + [3.0] * max(0, k - 3)}, draft_ms={"1": 0.2}).save(path)
    return path


def test_dspark_recipe_rehearses(chat_file, tmp_path):
    res = run_module("train.__main__", "--config", "configs/dspark.yaml",
                     *tiny_overrides(chat_file, tmp_path / "run", **{"eval.num_sequences": 2, "eval.temperatures": [0]}),
                     "trainer.fast_dev_run=true", "trainer.precision=32-true", "drafter.dspark.layers=1",
                     "drafter.dspark.block_size=4", "drafter.dspark.markov_rank=16",
                     f"eval.step_costs={write_step_costs(tmp_path / 'costs.json', k=3)}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rehearsal (trainer.fast_dev_run) passed" in res.stdout
    assert "at T=0, adaptive verification: tau = " in res.stdout  # the promise with adaptive verification too
