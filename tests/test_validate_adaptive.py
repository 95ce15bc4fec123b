"""inference.validate on a tiny DSpark export: the promise at T = 0 and T = 1 (standard and block)
is compared as DFlash's, and with --adaptive-verification the adaptive promise (the same step-cost
table, batch 1) is the one held to; at T = 0 in float32 the replay of the served answers equals the
runtime's measurement exactly, with and without adaptive verification (the walk verifies the width
the runtime chose). What the flag cannot compare is refused in one line."""
import json
import shutil

import pytest
import torch

from inference.runtime.adaptive import StepCosts, choose_width, step_ms_tensor
from inference.validate import main, validate
from inference.walks.greedy import chain_widths
from models.acceptance import Acceptance, HeldoutPrediction, Prediction, Promise

K = 2
COSTS = StepCosts(target="tiny-random-llama", device="cpu", dtype="float32",
                  verify_ms={"1": [1.0 + 0.8 * n for n in range(K + 1)]}, draft_ms={"1": 0.5})


def _drafter(hf, **heads):
    """A DSpark drafter warm-started from the tiny target, drafting over its first 512 tokens (a
    small head: fast), its trained weights random (the heads' included, so the confidences vary
    and the chosen widths with them)."""
    from models.dspark import DSparkConfig, DSparkDrafter

    V, vd = hf.config.vocab_size, 512
    torch.manual_seed(0)
    d = DSparkDrafter(DSparkConfig.from_target(hf.config, vd, mask_token_id=0, num_layers=1, block_size=4, markov_rank=4,
                                               **heads))
    d.init_from_target(hf, torch.zeros(vd, dtype=torch.long), torch.arange(V) < vd)
    for p in d.parameters():
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    return d.eval()


def _promise(step_costs: dict | None) -> dict:
    """A promise with every figure distinct: greedy tau 1.5, then one per sampled setting."""
    def acc(n):  # accepted lengths 0..K, n chains of full length
        return Acceptance.from_histogram(torch.tensor([4, 4, n]), with_error=True)

    sampled = [Promise(1.0, "standard", acc(1)), Promise(1.0, "block", acc(2)), Promise(0.0, "adaptive", acc(3)),
               Promise(1.0, "adaptive-standard", acc(5)), Promise(1.0, "adaptive-block", acc(6))]
    held = HeldoutPrediction(Acceptance.from_histogram(torch.tensor([4, 4, 8])), tuple(sampled))
    return Prediction(held, dataset="heldout", k=K, step=1, step_costs=step_costs).to_dict()


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from export.dspark import export_dspark
    from models.zoo import resolve_target

    root = tmp_path_factory.mktemp("validate_adaptive")
    hf = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-random-llama"), dtype=torch.float32)
    COSTS.save(root / "costs.json")
    made = {}
    for name, heads, costs in (("dspark", {}, COSTS.to_dict()), ("no_head", {"confidence_head": False}, COSTS.to_dict()),
                               ("path_only", {}, None)):
        provenance = {"target": "tiny-random-llama", "predicted_acceptance": _promise(costs),
                      "promise_config": {"eval": {"k": K, "step_costs": str(root / "costs.json")}}}
        made[name] = export_dspark(_drafter(hf, **heads), root / name, target_name="tiny-random-llama",
                                   dtype=torch.float32, provenance=provenance)
    return root, made


def _run(export, out, **kw):
    return validate(str(export), "mt-bench", num_prompts=2, max_new_tokens=8, out=str(out), device="cpu", tolerance=100,
                    progress=False, max_turns=1, anchors=8, **kw)


def test_widths_replayed_are_the_runtimes_choice_at_batch_1():
    torch.manual_seed(0)
    confidence = torch.cat([torch.rand(32, 4), 0.9 + 0.1 * torch.rand(32, 4)])
    step_ms = torch.tensor([1.0, 2.0, 3.0, 3.05, 3.1])  # a jump, then flat: the causal and best-rate rules part
    for causal in (False, True):
        widths = chain_widths(step_ms, causal=causal)(confidence)
        runtime = [int(choose_width(c[None], torch.ones(1, dtype=torch.bool), step_ms, causal)) for c in confidence]
        assert widths.tolist() == runtime
    assert chain_widths(step_ms)(confidence).tolist() != chain_widths(step_ms, causal=True)(confidence).tolist()


def test_promise_at_reads_the_adaptive_entries_and_the_table_round_trips():
    p = Prediction.from_dict(json.loads(json.dumps(_promise(COSTS.to_dict()))))
    assert StepCosts.from_dict(p.step_costs) == COSTS and p.for_set("heldout").step_costs == p.step_costs
    assert p.promise_at(0.0, "standard").verification == "greedy"
    assert p.promise_at(0.0, "standard", adaptive=True).verification == "adaptive"
    assert p.promise_at(1.0, "block", adaptive=True).verification == "adaptive-block"
    assert p.promise_at(1.0, "standard", adaptive=True).acceptance.tau != p.promise_at(1.0, "standard").acceptance.tau
    assert p.promise_at(0.7, "standard", adaptive=True) is None


def test_validate_dspark_with_and_without_adaptive_verification(exports, tmp_path):
    root, made = exports
    costs_file = str(root / "costs.json")
    predicted = Prediction.from_dict(_promise(None))
    for temperature, verification in ((0.0, "standard"), (1.0, "standard"), (1.0, "block")):
        for adaptive in (False, True):
            out = tmp_path / f"T{temperature:g}-{verification}-{adaptive}"
            # (at T = 1 with block verification, the promise that records only its table's path:
            # validate checks that file instead)
            export = made["path_only" if adaptive and verification == "block" else "dspark"]
            report = _run(export, out, temperature=temperature, verification=verification,
                          adaptive_costs=costs_file if adaptive else None)
            saved = json.loads((out / "report.json").read_text())
            assert saved["relative_gap"] == pytest.approx(report["relative_gap"])
            promise = predicted.promise_at(temperature, verification, adaptive)
            assert saved["predicted"]["tau"] == pytest.approx(promise.acceptance.tau), (temperature, verification, adaptive)
            assert saved["measured"]["num_chains"] > 0 and saved["batch_size"] == 1
            if temperature == 0:  # the replay walks the runtime's very chains, widths included
                assert saved["replay_answers"]["histogram"] == saved["measured"]["histogram"], adaptive
            record = saved["adaptive_verification"]
            if not adaptive:
                assert record is None
                continue
            assert StepCosts.from_dict(record["step_costs"]) == COSTS
            assert record["promise_table"] == (costs_file if export == made["path_only"] else "the promise")
            # the steep table cuts some chains to 1 draft: the runtime chose widths
            assert 1 <= record["verified_drafts_per_row_step"] < K
            assert any(line.startswith("Adaptive verification: served one question at a time") for line in saved["diagnosis"])
            assert "Adaptive verification: each step verified" in (out / "report.md").read_text()


def test_what_adaptive_validation_cannot_compare_is_refused_in_one_line(exports, tmp_path, capsys):
    root, made = exports
    other = StepCosts(**{**COSTS.__dict__, "draft_ms": {"1": 0.7}})
    other.save(tmp_path / "other.json")
    no_promise = tmp_path / "no_promise"
    shutil.copytree(made["dspark"], no_promise)
    meta = json.loads((no_promise / "draftsmith.json").read_text())
    meta["predicted_acceptance"]["sampled"] = [p for p in meta["predicted_acceptance"]["sampled"]
                                               if not p["verification"].startswith("adaptive")]
    (no_promise / "draftsmith.json").write_text(json.dumps(meta))
    base = ["--dataset", "mt-bench", "--num-prompts", "1", "--max-new-tokens", "4", "--device", "cpu"]
    costs = str(root / "costs.json")
    cases = [(made["dspark"], ["--adaptive-verification", str(tmp_path / "other.json")], "draft_ms differ"),
             (made["path_only"], ["--adaptive-verification", str(tmp_path / "other.json")], str(root / "costs.json")),
             (made["dspark"], ["--adaptive-verification", costs, "--batch-size", "2"], "--batch-size 2"),
             (made["dspark"], ["--adaptive-verification", costs, "--tree", "2,2,4"], "leave out --tree"),
             (made["dspark"], ["--adaptive-verification", costs, "-k", "1"], "-k 1"),
             (made["no_head"], ["--adaptive-verification", costs], "no confidence head"),
             (no_promise, ["--adaptive-verification", costs, "--temperature", "1"], "promises nothing with adaptive"),
             (made["dspark"], ["--adaptive-verification", str(tmp_path / "missing.json")], "no such step-cost table")]
    for i, (export, extra, said) in enumerate(cases):
        out = tmp_path / f"refused{i}"
        assert main(["--drafter", str(export), *base, *extra, "--out", str(out)]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: --adaptive-verification") and said in err and len(err.splitlines()) == 1, err
        assert not out.exists()
