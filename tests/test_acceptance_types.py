"""The typed acceptance results (models/acceptance.py) and the validation report
(inference/report.py): they write the JSON files have always held, read it back unchanged, and
name the key a file lacks."""
import json

import pytest
import torch

from inference.walks.greedy import acceptance_from_histogram
from models.acceptance import Acceptance, HeldoutPrediction, Prediction, Promise, TreePromise, tau_at


def _prediction() -> Prediction:
    turns = torch.tensor([[3, 2, 1, 4], [1, 0, 2, 5]])
    sampled = torch.tensor([[0.5, 1.25, 2.25, 1.0], [0.25, 0.75, 1.0, 2.0]], dtype=torch.float64)
    held = HeldoutPrediction(Acceptance.by_turn(turns), (Promise(1.0, "block", Acceptance.by_turn(sampled, with_error=True)),),
                             (TreePromise(2, 2, 4, Acceptance.by_turn(torch.tensor([[1, 2, 3], [0, 1, 1]]))),
                              TreePromise(2, 3, 5, Acceptance.by_turn(torch.tensor([[2, 2, 1], [0, 1, 3]])), children=1)))
    return Prediction(held, dataset="heldout", k=3, step=7, also={"other": HeldoutPrediction(Acceptance.by_turn(turns))})


def test_acceptance_is_the_definition_on_the_histogram():
    acc = Acceptance.from_histogram([4, 2, 1, 3])
    at_least = [10, 6, 4, 3]
    assert acc.a == pytest.approx([at_least[i] / at_least[i - 1] for i in (1, 2, 3)])
    assert acc.tau == pytest.approx(1 + sum(at_least[1:]) / 10) == pytest.approx(tau_at(acc.a, 3))
    assert acc.num_chains == 10 and acc.histogram == (4, 2, 1, 3) and acc.tau_se is None
    assert acceptance_from_histogram([4, 2, 1, 3]) == acc.to_dict()  # the runtime's stats print the same


def test_the_prediction_writes_the_keys_files_hold_and_reads_them_back():
    predicted = _prediction()
    d = json.loads(json.dumps(predicted.to_dict()))
    assert list(d) == ["a", "tau", "num_chains", "histogram", "per_turn", "sampled", "trees", "dataset", "k",
                       "temperature", "step", "also"]
    assert set(d["per_turn"]) == {"1", "2+"} and list(d["per_turn"]["1"]) == ["a", "tau", "num_chains", "histogram"]
    assert list(d["sampled"][0]) == ["temperature", "verification", "a", "tau", "num_chains", "histogram", "tau_se",
                                     "per_turn"]
    assert list(d["trees"][0])[:4] == ["depth", "top_k", "total_tokens", "verify_tokens_per_step"]
    assert d["trees"][0]["verify_tokens_per_step"] == 5 and d["sampled"][0]["histogram"][0] == 0.75
    # a tree with its own children count says so; a square one holds no such key (as files before it)
    assert list(d["trees"][1])[:5] == ["depth", "top_k", "total_tokens", "children", "verify_tokens_per_step"]
    assert predicted.heldout.trees[1].shape == (2, 3, 5, 1) and predicted.heldout.trees[0].shape == (2, 2, 4)
    assert list(d["also"]["other"]) == ["a", "tau", "num_chains", "histogram", "per_turn"]
    assert Prediction.from_dict(d) == predicted


def test_an_old_promise_file_reads_with_what_it_holds():
    old = {"a": [0.5, 0.25], "tau": 1.625, "num_chains": 8, "histogram": [4, 2, 2], "k": 2, "temperature": 0.0, "step": 3}
    predicted = Prediction.from_dict(old)
    assert predicted.greedy.per_turn is None and predicted.heldout.sampled == () and predicted.dataset is None
    assert predicted.promise_at(1.0, "standard") is None and predicted.promise_at(0.0, "block").acceptance.tau == 1.625
    assert predicted.to_dict() == old


@pytest.mark.parametrize("path,key", [((), "num_chains"), (("per_turn", "2+"), "histogram"), (("sampled", 0), "verification"),
                                      (("trees", 0), "total_tokens"), (("also", "other"), "a")])
def test_a_missing_key_is_named(path, key):
    d = _prediction().to_dict()
    node = d
    for step in path:
        node = node[step]
    del node[key]
    with pytest.raises(ValueError, match=f"missing key '{key}'"):
        Prediction.from_dict(d, "draftsmith.json: predicted_acceptance")


def test_the_validation_report_reads_back_from_its_json():
    from inference.report import Measured, Promised, ValidationReport

    acc = Acceptance.from_histogram([3, 1, 2])
    report = ValidationReport(
        drafter="x", target="t", dataset="mt-bench", k=2, temperature=0.0, verification="standard", device="cpu",
        num_questions=1, questions_planned=2, num_answers=2, batch_size=1, max_new_tokens=8,
        predicted=Promised(acc.a, acc.tau, acc.histogram, "held-out d, greedy (T = 0)", 0.0, "greedy",
                           per_turn={"1": {"tau": 1.5, "num_chains": 4}}),
        measured=Measured(acc, 12.5), replay_answers=acc, replay_prompts=acc, per_category={"writing": acc},
        per_turn={1: acc, 2: acc}, turns=None, relative_gap=0.0, tolerance=0.1, passed=True,
        references={"ngram": Measured(acc, 20.0)}, tree=None, diagnosis=("No runtime gap.",))
    d = report.to_dict()
    assert d["pass"] is True and d["measured"]["tokens_per_s"] == 12.5 and set(d["per_turn"]) == {1, 2}
    assert list(d["predicted"]) == ["a", "tau", "histogram", "temperature", "verification", "source", "per_turn"]
    assert ValidationReport.from_dict(json.loads(json.dumps(d))) == report
    del d["predicted"]["source"]
    with pytest.raises(ValueError, match="report.json: predicted: missing key 'source'"):
        ValidationReport.from_dict(d)
