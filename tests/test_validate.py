"""Acceptance validation on a tiny trained drafter: report files, verdict, diagnosis."""
import json
import subprocess
import sys

import pytest

from inference.validate import diagnose, tau_at
from tests.conftest import run_module, tiny_overrides
from train.config import load_config
from train.run import run


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from tests.conftest import make_conversations

    root = tmp_path_factory.mktemp("validate")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(120)))
    # whole answers walked (no chain cap): follow-up turns get chains too
    # tree promises too (eval.trees), beside the chain figures: a square tree and one whose kept
    # nodes below the root have 1 child each
    run(load_config(None, tiny_overrides(str(chat), root / "run", **{"trainer.max_steps": 2, "eval.anchors_per_sequence": None,
                                                                      "eval.trees": [[2, 2, 4], [2, 2, 3, 1]]})))
    return root / "run" / "export"


def test_validate_writes_the_three_reports_on_mt_bench(tiny_export, tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "inference.validate", "--drafter", str(tiny_export), "--dataset", "mt-bench",
           "--num-prompts", "3", "--max-new-tokens", "12", "--out", str(out), "--tolerance", "100"]
    res = subprocess.run(cmd + ["--reference", "ngram", "--reference", "suffix"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PASS" in res.stdout
    for name in ("report.json", "report.md", "acceptance_per_position.png", "tau_per_category.png", "accepted_lengths.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert report["num_questions"] == 3 and report["num_answers"] == 6  # mt-bench: both turns
    assert set(report["per_turn"]) == {"1", "2"}
    assert report["measured"]["num_chains"] > 0 and len(report["measured"]["a"]) == report["k"] == 3
    assert report["replay_answers"]["num_chains"] > 0 and report["diagnosis"]
    # reference rows: the same prompts served by n-gram and suffix decoding, same k
    assert set(report["references"]) == {"ngram", "suffix"}
    assert all(r["num_chains"] > 0 and len(r["a"]) == 3 for r in report["references"].values())
    assert "| suffix |" in (out / "report.md").read_text() and "reference ngram: tau" in res.stdout
    predicted = json.loads((tiny_export / "draftsmith.json").read_text())["predicted_acceptance"]
    assert report["predicted"]["tau"] == pytest.approx(predicted["tau"])
    # the promise knows first answers from follow-up turns, and the report weighs it as served
    turns = predicted["per_turn"]
    assert turns["1"]["num_chains"] > 0 and turns["2+"]["num_chains"] > 0
    assert turns["1"]["num_chains"] + turns["2+"]["num_chains"] == predicted["num_chains"]
    assert report["turns"]["follow_up_share"]["served"] > 0
    assert any(line.startswith("Turns: first answers predicted") for line in report["diagnosis"])

    # an export that promised far more than it delivers fails with exit 1 and says why
    import shutil

    promised = tmp_path / "promised"
    shutil.copytree(tiny_export, promised)
    meta = json.loads((promised / "draftsmith.json").read_text())
    meta["predicted_acceptance"].update(a=[0.9, 0.9, 0.9], histogram=None)
    (promised / "draftsmith.json").write_text(json.dumps(meta))
    cmd[cmd.index(str(tiny_export))] = str(promised)
    res = run_module("inference.validate", *cmd[3:-2], "--tolerance", "0.1", "--max-turns", "1", "--out",
                     str(tmp_path / "strict"))
    assert res.returncode == 1 and "FAIL" in res.stdout and "Data gap" in res.stdout, res.stdout + res.stderr[-1000:]


def test_max_minutes_reports_the_questions_served(tiny_export, tmp_path):
    from inference.validate import validate

    report = validate(str(tiny_export), "mt-bench", num_prompts=3, max_new_tokens=8, out=str(tmp_path / "r"),
                      device="cpu", tolerance=100, progress=False, max_minutes=1e-6)  # past after the first question
    assert report["num_questions"] == 1 and report["questions_planned"] == 3 and report["num_answers"] == 2
    assert report["measured"]["num_chains"] > 0
    assert "Stopped by --max-minutes after 1 of 3 questions" in (tmp_path / "r" / "report.md").read_text()


def test_bad_input_is_one_line(tiny_export, tmp_path):
    res = run_module("inference.validate", "--drafter", str(tmp_path), "--dataset", "mt-bench")
    assert res.returncode == 2 and "not an export folder" in res.stderr and "Traceback" not in res.stderr
    res = run_module("inference.validate", "--drafter", str(tiny_export), "--dataset", "mt-bench", "-k", "9")
    assert res.returncode == 2 and "at most 3" in res.stderr


def test_tau_at_matches_the_definition():
    assert tau_at([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_at([0.5, 0.5, 0.9], 1) == pytest.approx(1.5)


def test_diagnosis_separates_runtime_and_data_gaps():
    def acc(tau, a):
        return {"tau": tau, "a": a}

    predicted = acc(3.0, [0.8, 0.8])
    cats = {"writing": acc(1.5, [0.3, 0.3]), "coding": acc(2.5, [0.7, 0.7])}
    runtime = diagnose(predicted, acc(1.5, [0.4, 0.3]), acc(3.0, [0.8, 0.8]), None, cats, 0.1)
    assert runtime[0].startswith("Runtime gap") and not any(line.startswith("Data gap") for line in runtime)
    data = diagnose(predicted, acc(1.5, [0.4, 0.3]), acc(1.55, [0.4, 0.3]), acc(1.2, [0.1, 0.1]), cats, 0.1)
    assert data[0].startswith("No runtime gap") and any(line.startswith("Data gap") for line in data)
    assert any("a_1" in line for line in data) and any(line.startswith("Lowest categories: writing") for line in data)


def test_diagnosis_names_a_promise_made_for_another_answer_budget():
    def acc(tau):
        return {"tau": tau, "a": [0.5]}

    lines = diagnose(acc(2.0), acc(1.8), acc(1.8), None, {}, 0.1, budgets=(None, 256), export="runs/x/export")
    assert lines[0].startswith("Answer budget: the promise walked whole answers but answers were served up to 256")
    assert "python -m train.promise runs/x/export eval.max_new_tokens=256" in lines[0]
    assert not any("Answer budget" in line for line in diagnose(acc(2.0), acc(1.8), acc(1.8), None, {}, 0.1,
                                                                 budgets=(256, 256)))


def test_diagnosis_names_a_sampled_promise_made_on_greedy_text():
    from inference.validate import promised_on_samples

    promise = {"tau": 2.5, "a": [0.5], "temperature": 1.0}
    lines = diagnose(promise, {"tau": 1.7, "a": [0.4]}, {"tau": 1.7, "a": [0.4]}, None, {}, 0.05, temperature=1.0,
                     export="runs/x/export", sampled_text=False)
    assert lines[0].startswith("Sampled text: the promise at T = 1 walked the target's greedy answers")
    assert "python -m train.promise runs/x/export eval.sampled_answers={1: FILE}" in lines[0]
    on_samples = diagnose(promise, {"tau": 1.7, "a": [0.4]}, {"tau": 1.7, "a": [0.4]}, None, {}, 0.05, temperature=1.0,
                          sampled_text=True)
    assert not any(line.startswith("Sampled text") for line in on_samples)
    trained = {"training_config": {"eval": {"sampled_answers": {"1.0": "t1.jsonl"}}}}
    assert promised_on_samples(trained, 1.0) is True and promised_on_samples(trained, 0.7) is False
    assert promised_on_samples({"promise_config": {"eval": {}}, **trained}, 1.0) is False  # the promise's own settings
    assert promised_on_samples(trained, 0.0) is None


def test_turn_mix_weighs_the_promise_as_served():
    from inference.validate import turn_mix

    predicted = {"1": {"tau": 2.0, "num_chains": 300}, "2+": {"tau": 3.0, "num_chains": 100}}
    measured = {1: {"tau": 2.1, "num_chains": 60}, 2: {"tau": 3.5, "num_chains": 30}, 3: {"tau": 2.5, "num_chains": 10}}
    mix = turn_mix(predicted, measured)
    assert mix["measured"]["follow_up"] == pytest.approx((3.5 * 30 + 2.5 * 10) / 40)
    assert mix["follow_up_share"] == pytest.approx({"heldout": 0.25, "served": 0.4})
    assert mix["promise_at_served_mix"] == pytest.approx(0.6 * 2.0 + 0.4 * 3.0)
    # measured overall (chain-weighted) minus that promise = the two parts' contributions
    overall = (2.1 * 60 + 3.5 * 30 + 2.5 * 10) / 100
    assert sum(mix["gap_carried"].values()) == pytest.approx(overall - mix["promise_at_served_mix"])
    assert mix["gap_carried"] == pytest.approx({"first": 0.6 * 0.1, "follow_up": 0.4 * 0.25})
    assert turn_mix(predicted, {1: measured[1]}) is None  # one turn served: nothing to weigh
    assert turn_mix({}, measured) is None  # an export from before per-turn promises
    lines = diagnose({"tau": 2.25, "a": [0.5]}, {"tau": 2.6, "a": [0.6]}, {"tau": 2.6, "a": [0.6]}, None, {}, 0.1,
                     turns=mix)
    turn_line = next(line for line in lines if line.startswith("Turns:"))
    assert "follow-up turns predicted 3.000, measured 3.250" in turn_line and "the promise would be 2.400" in turn_line
    assert any(line.startswith("The gap against that weighted promise is carried mostly by follow-up turns") for line in lines)


def test_validate_and_generate_serve_a_medusa_export(tmp_path):
    from tests.conftest import make_conversations

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(120)))
    run(load_config("configs/medusa1.yaml", tiny_overrides(str(chat), tmp_path / "run", **{"trainer.max_steps": 2,
                                                                                            "trainer.precision": "32-true"})))
    export = tmp_path / "run" / "export"
    res = run_module("inference.validate", "--drafter", str(export), "--dataset", "mt-bench", "--num-prompts", "2",
                     "--max-turns", "1", "--max-new-tokens", "10", "--tolerance", "100", "--out", str(tmp_path / "report"))
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["measured"]["num_chains"] > 0 and report["k"] == 3
    res = run_module("inference.generate", "--target", "tiny-random-llama", "--prompt", "hi", "--proposer", "drafter",
                     "--drafter", str(export), "-k", "3", "--max-new-tokens", "8", "--stats")
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"acceptance"' in res.stderr


def test_an_export_made_elsewhere_is_validated_against_the_replay(tiny_export, tmp_path):
    """No draftsmith.json (a folder from another trainer): nothing was promised, so the served
    acceptance is held against training's predictor on the served answers, the runtime gap."""
    import shutil

    foreign = tmp_path / "foreign"
    shutil.copytree(tiny_export, foreign)
    (foreign / "draftsmith.json").unlink()
    base = [sys.executable, "-m", "inference.validate", "--drafter", str(foreign), "--dataset", "mt-bench",
            "--num-prompts", "2", "--max-new-tokens", "10", "--max-turns", "1"]
    res = run_module(*base[2:], "--out", str(tmp_path / "a"))
    assert res.returncode == 2 and "pass -k" in res.stderr and "Traceback" not in res.stderr
    res = run_module(*base[2:], "-k", "3", "--out", str(tmp_path / "b"))
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    # the served config names the verifier (a zoo target without an upstream hub id by its local folder)
    from models.zoo import resolve_target

    assert "no promise" in report["predicted"]["source"]
    assert report["target"] in ("tiny-random-llama", str(resolve_target("tiny-random-llama")))
    assert report["predicted"]["tau"] == pytest.approx(report["replay_answers"]["tau"])
    assert abs(report["relative_gap"]) <= 0.1  # the runtime drafts what training's predictor drafts


def test_num_prompts_takes_every_category_in_turn():
    from inference.validate import load_prompts_for

    rows = load_prompts_for("mt-bench", {}, 16)  # MT-bench lists 10 questions per category, category after category
    categories = [r["category"] for r in rows]
    assert len(rows) == 16 and len(set(categories)) == 8 and all(categories.count(c) == 2 for c in set(categories))
    assert len(load_prompts_for("mt-bench", {}, None)) == 80


def test_questions_served_in_batches_give_the_same_answers_and_chains(tiny_export, tmp_path):
    """Batched serving (the GPU default) changes the speed, not what is measured (float32)."""
    from inference.validate import validate

    one, three = (validate(str(tiny_export), "mt-bench", num_prompts=3, max_new_tokens=10, out=str(tmp_path / f"b{b}"),
                           device="cpu", tolerance=100, progress=False, batch_size=b, references_to_run=("ngram",))
                  for b in (1, 3))
    assert three["batch_size"] == 3 and three["num_answers"] == one["num_answers"] == 6
    for key in ("measured", "replay_answers"):
        assert three[key]["histogram"] == one[key]["histogram"]
    assert three["references"]["ngram"]["histogram"] == one["references"]["ngram"]["histogram"]
    assert three["per_turn"] == one["per_turn"]


def test_sampled_serving_is_held_to_the_promise_at_its_temperature_and_humaneval_validates(tiny_export, tmp_path):
    """At T = 1 validate compares with the export's T = 1 promise for the served verification (an
    export without one keeps its greedy promise as a reference and says so); HumanEval serves
    one code question per answer."""
    import shutil

    from inference.validate import validate

    promise = json.loads((tiny_export / "draftsmith.json").read_text())["predicted_acceptance"]
    block = next(e for e in promise["sampled"] if e["temperature"] == 1.0 and e["verification"] == "block")
    report = validate(str(tiny_export), "mt-bench", num_prompts=2, max_new_tokens=8, out=str(tmp_path / "t1"),
                      device="cpu", tolerance=100, progress=False, temperature=1.0, verification="block")
    assert report["predicted"]["tau"] == pytest.approx(block["tau"]) and report["predicted"]["temperature"] == 1.0
    assert report["predicted"]["verification"] == "block" and report["predicted"]["tau_se"] == block["tau_se"]
    assert report["replay_answers"]["num_chains"] > 0 and "tau_se" in report["measured"]
    assert not any(line.startswith("Sampling:") for line in report["diagnosis"])
    assert "block verification" in (tmp_path / "t1" / "report.md").read_text()

    old = tmp_path / "old"  # a promise file from before sampled promises: greedy only
    shutil.copytree(tiny_export, old)
    meta = json.loads((old / "draftsmith.json").read_text())
    del meta["predicted_acceptance"]["sampled"]
    (old / "draftsmith.json").write_text(json.dumps(meta))
    report = validate(str(old), "mt-bench", num_prompts=1, max_new_tokens=8, out=str(tmp_path / "old_r"),
                      device="cpu", tolerance=100, progress=False, temperature=1.0)
    assert report["predicted"]["tau"] == pytest.approx(promise["tau"]) and report["predicted"]["temperature"] == 0.0
    assert any(line.startswith("Sampling: the export promises nothing at T = 1") for line in report["diagnosis"])

    report = validate(str(tiny_export), "humaneval", num_prompts=2, max_new_tokens=8, out=str(tmp_path / "he"),
                      device="cpu", tolerance=100, progress=False)
    assert report["num_questions"] == 2 and report["num_answers"] == 2 and set(report["per_turn"]) == {1}
    assert set(report["per_category"]) == {"humaneval"} and report["measured"]["num_chains"] > 0
    assert report["predicted"]["temperature"] == 0.0


def test_validate_tree_holds_served_trees_to_the_tree_promise(tiny_export, tmp_path, capsys):
    """--tree serves EAGLE-2 trees and compares their tau with the export's promise for that tree;
    the promise sits beside the chain figures, which keep their keys."""
    from inference.validate import main
    from tests.test_bench_cli import _random_exports

    predicted = json.loads((tiny_export / "draftsmith.json").read_text())["predicted_acceptance"]
    assert {"a", "tau", "histogram", "num_chains", "per_turn", "sampled", "k", "dataset", "step"} <= set(predicted)
    tree, narrow = predicted["trees"]
    assert (tree["depth"], tree["top_k"], tree["total_tokens"], tree["verify_tokens_per_step"]) == (2, 2, 4, 5)
    assert (narrow["depth"], narrow["top_k"], narrow["total_tokens"], narrow["children"]) == (2, 2, 3, 1)
    assert len(tree["a"]) == 2 and tree["num_chains"] > 0 and set(tree["per_turn"]) == {"1", "2+"}
    assert tree["num_chains"] == sum(tree["histogram"])
    out = tmp_path / "tree"
    base = ["--drafter", str(tiny_export), "--dataset", "mt-bench", "--num-prompts", "2", "--max-new-tokens", "8",
            "--max-turns", "1", "--tolerance", "100"]
    assert main(base + ["--tree", "2,2,4", "--out", str(out)]) == 0
    assert "tree depth 2, top-k 2, 4 nodes (5 verify tokens per step):" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["tree"] == {"depth": 2, "top_k": 2, "total_tokens": 4, "verify_tokens_per_step": 5} and report["k"] == 2
    assert report["predicted"]["tau"] == pytest.approx(tree["tau"]) and "tree depth 2" in report["predicted"]["source"]
    assert report["measured"]["num_chains"] > 0 and len(report["measured"]["a"]) == 2
    # the walk over the served answers replays the runtime's own trees
    assert report["replay_answers"]["histogram"] == report["measured"]["histogram"]
    assert "EAGLE-2 trees of depth 2" in (out / "report.md").read_text()
    # the narrow tree, held to its own promise (2,2,4,2 names the square tree: its children are top_k)
    assert main(base + ["--tree", "2,2,3,1", "--out", str(tmp_path / "narrow")]) == 0
    assert "tree depth 2, top-k 2, 1 child, 3 nodes" in capsys.readouterr().out
    report = json.loads((tmp_path / "narrow" / "report.json").read_text())
    assert report["tree"]["children"] == 1 and report["predicted"]["tau"] == pytest.approx(narrow["tau"])
    assert report["replay_answers"]["histogram"] == report["measured"]["histogram"]
    assert "EAGLE-2 trees of depth 2, top-k 2, 1 child, 3 nodes" in (tmp_path / "narrow" / "report.md").read_text()
    # one line each: a tree not promised, sampling, a drafter that drafts no trees
    medusa = _random_exports(tmp_path)[1]
    for extra, phrase in ((["--tree", "3,2,6"], "--tree 3,2,6: the export promises no such tree (it promises 2,2,4; "
                                                "2,2,3,1)"),
                          (["--tree", "2,2,4", "--temperature", "1"], "a tree's promise is greedy for now"),
                          (["--tree", "2,2,9"], "--tree 2,2,9: nodes at most the 6 candidates"),
                          (["--tree", "2,2,4", "--drafter", medusa, "--target", "tiny-random-llama"],
                           "draft trees are drafted by EAGLE-3 drafters for now")):
        assert main(base + extra + ["--out", str(tmp_path / "bad")]) == 2, extra
        err = capsys.readouterr().err
        assert phrase in err and "Traceback" not in err, repr(err)


def test_promise_set_holds_serving_to_that_sets_promise_and_serves_only_questions_it_did_not_walk(tiny_export, tmp_path):
    """--promise-set NAME: the promise on that held-out set of eval.datasets (here HumanEval's
    answered questions), and only questions that set did not walk are served; a set the export
    does not promise on is one line naming those it does."""
    import shutil

    from data.sources import prompt_conversations
    from inference.served import load_prompts_for
    from inference.validate import validate

    walked = prompt_conversations("humaneval")[:3]  # "answered" first three problems
    he_set = tmp_path / "he.jsonl"
    he_set.write_text("".join(json.dumps({"messages": [c[0], {"role": "assistant", "content": "return x"}]}) + "\n"
                              for c in walked))
    export = tmp_path / "export"
    shutil.copytree(tiny_export, export)
    meta = json.loads((export / "draftsmith.json").read_text())
    own = {key: meta["predicted_acceptance"][key] for key in ("a", "tau", "histogram", "num_chains")}
    own["a"] = [0.5 ** (i + 1) for i in range(len(own["a"]))]
    own["tau"] = tau_at(own["a"], len(own["a"]))  # a promise unlike the first set's
    meta["predicted_acceptance"]["also"] = {str(he_set): own}
    (export / "draftsmith.json").write_text(json.dumps(meta))

    served = load_prompts_for("humaneval", meta, 2, leave_out=frozenset(c[0]["content"] for c in walked))
    assert [q["id"] for q in served] == ["HumanEval/3", "HumanEval/4"]
    report = validate(str(export), "humaneval", num_prompts=2, max_new_tokens=8, out=str(tmp_path / "he"), device="cpu",
                      tolerance=100, progress=False, promise_set=str(he_set))
    assert report["predicted"]["tau"] == pytest.approx(tau_at(own["a"], len(own["a"])))
    assert report["predicted"]["tau"] != pytest.approx(meta["predicted_acceptance"]["tau"])
    assert report["num_questions"] == 2
    assert report["diagnosis"][0].startswith(f"Promise set: held to the promise on {he_set}; the 3 questions that set holds")

    # that set was not walked at T = 1 (only the first set is, on sampled answers): no promise there
    with pytest.raises(ValueError, match="no promise at T = 1 .standard. on that set"):
        validate(str(export), "humaneval", num_prompts=1, max_new_tokens=4, out=str(tmp_path / "t1"), device="cpu",
                 progress=False, promise_set=str(he_set), temperature=1.0)
    # a conversation that asks nothing (no user turn) is no question of the set
    from inference.served import first_questions

    odd = tmp_path / "odd.jsonl"
    odd.write_text(he_set.read_text() + json.dumps({"messages": [{"role": "system", "content": "s"},
                                                                 {"role": "assistant", "content": "a"}]}) + "\n")
    assert first_questions(str(odd)) == {c[0]["content"] for c in walked}

    res = run_module("inference.validate", "--drafter", str(export), "--dataset", "humaneval", "--promise-set",
                     "elsewhere.jsonl", "--out", str(tmp_path / "x"), "--device", "cpu")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: --promise-set elsewhere.jsonl: the export promises on ")
    assert str(he_set) in res.stderr and not (tmp_path / "x" / "report.json").exists()
