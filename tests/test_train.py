"""End to end on the tiny target: CLI, checkpoints, resume, export, predicted acceptance."""
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import interrupt_training_at, run_module, tiny_overrides
from train.config import load_config
from train.run import run


def _final_weights(out_dir):
    ckpt = torch.load(out_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return ckpt["state_dict"], ckpt["global_step"]


def test_cli_fast_dev_run(chat_file, tmp_path):
    res = subprocess.run([sys.executable, "-m", "train", *tiny_overrides(chat_file, tmp_path / "run"),
                          "trainer.fast_dev_run=true"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


def test_end_to_end_writes_export_and_predicted(chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    summary = run(load_config(None, tiny_overrides(chat_file, out)))
    pred = json.loads((out / "predicted.json").read_text())
    assert pred["predicted"]["k"] == 3 and len(pred["predicted"]["a"]) == 3
    assert 1.0 <= pred["predicted"]["tau"] <= 4.0 and pred["predicted"]["num_chains"] > 0
    assert summary["train_steps"] == 6
    # the final walk's seconds by part, beside fit_seconds (no trees asked for: none spent there)
    assert set(pred["walk_seconds"]) == {"greedy", "sampled", "trees"} and pred["walk_seconds"]["trees"] == 0
    assert pred["walk_seconds"]["greedy"] > 0 and pred["walk_seconds"]["sampled"] > 0
    # the promise at T = 1 for standard and block verification (eval.temperatures default [0, 1])
    sampled = {(e["temperature"], e["verification"]): e for e in pred["predicted"]["sampled"]}
    assert set(sampled) == {(1.0, "standard"), (1.0, "block")}
    for e in sampled.values():
        assert len(e["a"]) == 3 and 1.0 <= e["tau"] <= 4.0 and e["tau_se"] >= 0
        assert e["num_chains"] == e["per_turn"]["1"]["num_chains"] + e["per_turn"]["2+"]["num_chains"] > 0
        assert abs(sum(e["histogram"]) - e["num_chains"]) < 1e-6  # expected counts, one per chain
    # the promise made again for another answer budget and temperature, without training
    from train.promise import main as promise_main

    prov_path = out / "export" / "draftsmith.json"
    before = prov_path.read_bytes()
    assert promise_main([str(out / "export"), "optim.lr=1", "--no-progress"]) == 2  # not a serving setting
    assert promise_main([str(out / "export"), "eval.max_new_tokens=0", "--no-progress"]) == 2
    assert prov_path.read_bytes() == before
    old = json.loads(before)["predicted_acceptance"]
    assert promise_main([str(out / "export"), "eval.max_new_tokens=3", "eval.temperatures=[0]", "--no-progress"]) == 0
    prov = json.loads(prov_path.read_text())
    new = prov["predicted_acceptance"]
    assert prov["promise_config"]["eval"]["max_new_tokens"] == 3 and prov["promise_config"]["eval"]["temperatures"] == [0]
    assert prov["training_config"]["eval"]["max_new_tokens"] == 256  # how it was trained stays said
    assert prov["promise_history"][-1]["tau"] == old["tau"]
    assert prov["promise_history"][-1]["settings"]["eval"]["max_new_tokens"] == 256
    assert not new.get("sampled") and new["k"] == 3
    # three answer tokens leave at most two anchors per answer: far fewer chains than whole answers
    assert 0 < new["num_chains"] < old["num_chains"]
    # the promise at T = 1 walked on answers sampled at T = 1 (eval.sampled_answers): here the
    # held-out answers cut to two words, so it walks far fewer chains than the greedy text
    from data.chat import _is_heldout

    rows = [json.loads(line) for line in open(chat_file)]
    rows = [r for r in rows if _is_heldout(r["messages"], 0.1)]  # as `regenerate --heldout-only` writes them
    for r in rows:
        for m in r["messages"]:
            if m["role"] == "assistant":
                m["content"] = " ".join(m["content"].split()[:2])
    sampled_file = tmp_path / "sampled.jsonl"
    sampled_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert promise_main([str(out / "export"), "eval.sampled_answers={0.5: " + str(sampled_file) + "}", "--no-progress"]) == 2
    assert promise_main([str(out / "export"), "eval.temperatures=[0,1]", "eval.max_new_tokens=null", "--no-progress"]) == 0
    greedy_text = json.loads(prov_path.read_text())["predicted_acceptance"]
    on_greedy = {s["verification"]: s for s in greedy_text["sampled"]}
    assert promise_main([str(out / "export"), "eval.temperatures=[0,1]", "eval.sampled_answers={1: " + str(sampled_file) + "}",
                         "eval.max_new_tokens=null", "--no-progress"]) == 0
    prov = json.loads(prov_path.read_text())
    on_sampled = {s["verification"]: s for s in prov["predicted_acceptance"]["sampled"]}
    assert prov["promise_config"]["eval"]["sampled_answers"] == {"1.0": str(sampled_file)}
    for v in ("standard", "block"):
        assert 0 < on_sampled[v]["num_chains"] < on_greedy[v]["num_chains"]
    # the greedy promise walks the greedy answers either way
    assert prov["predicted_acceptance"]["histogram"] == greedy_text["histogram"]
    # a joint export trained its target too: its promise is not made again with the original one
    import shutil

    joint = tmp_path / "joint-export"
    shutil.copytree(out / "export", joint)
    tree = json.loads((joint / "draftsmith.json").read_text())
    tree["training_config"]["objective"]["joint"] = True
    drafter = tree["training_config"]["drafter"]  # (what a joint export's config says: a Medusa-2 drafter)
    del drafter["eagle3"]
    drafter["method"], drafter["medusa"] = "medusa", {}
    (joint / "draftsmith.json").write_text(json.dumps(tree))
    capsys.readouterr()
    assert promise_main([str(joint), "--no-progress"]) == 2
    assert "a joint export" in capsys.readouterr().err
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DraftModel"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in json.loads((out / "export" / "draftsmith.json").read_text())["drafter_config"]["aux_layer_ids"]]

    # the export reloads strictly and computes what the trained module computes
    from export.speculators import load_speculators

    reloaded = load_speculators(out / "export", dtype=torch.float32)
    state, _ = _final_weights(out)
    from models.eagle3 import Eagle3Drafter

    trained = Eagle3Drafter(reloaded.config)
    trained.load_state_dict({k[len("drafter."):]: v for k, v in state.items()})
    ids = torch.randint(0, 1000, (1, 12))
    aux = torch.randn(1, 12, len(reloaded.config.aux_layer_ids) * reloaded.config.target_hidden_size)
    a = reloaded.unroll(ids, aux, 3, greedy=True)
    b = trained.unroll(ids, aux, 3, greedy=True)
    for x, y in zip(a, b):  # export is bf16: same drafts, close logits
        assert torch.allclose(x, y, atol=0.1, rtol=0.05)


def test_resume_is_bit_for_bit(chat_file, tmp_path, monkeypatch):
    full = tmp_path / "full"
    run(load_config(None, tiny_overrides(chat_file, full)))
    expect, step = _final_weights(full)
    assert step == 6

    part = tmp_path / "part"
    restore = interrupt_training_at(monkeypatch, 3)
    from train.run_folder import TrainingInterrupted

    with pytest.raises(TrainingInterrupted):  # Lightning shuts down gracefully; run says where to resume
        run(load_config(None, tiny_overrides(chat_file, part)))
    _, step = _final_weights(part)
    assert step == 3
    restore()
    run(load_config(None, tiny_overrides(chat_file, part)), resume=str(part / "checkpoints" / "last.ckpt"))
    got, step = _final_weights(part)
    assert step == 6
    assert got.keys() == expect.keys()
    for k in expect:
        assert torch.equal(got[k], expect[k]), k


def test_checkpoint_holds_drafter_only_and_loads_strictly(chat_file, tmp_path):
    out = tmp_path / "run"
    run(load_config(None, tiny_overrides(chat_file, out, **{"trainer.max_steps": 3})))
    state, _ = _final_weights(out)
    assert all(k.startswith("drafter.") for k in state)
    from train.module import DrafterModule

    with pytest.raises(KeyError, match="outside the drafter"):
        DrafterModule.load_state_dict(object.__new__(DrafterModule), {"target.x": torch.zeros(1)})


def test_a_run_split_in_two_equals_one_run(chat_file, tmp_path):
    """schedule_steps lets a long run be cut into shorter resumed runs (device calls are
    limited in time) without changing a single weight."""
    one = tmp_path / "one"
    run(load_config(None, tiny_overrides(chat_file, one)))
    expect, _ = _final_weights(one)
    two = tmp_path / "two"
    run(load_config(None, tiny_overrides(chat_file, two, **{"trainer.max_steps": 3, "optim.schedule_steps": 6})))
    run(load_config(None, tiny_overrides(chat_file, two, **{"optim.schedule_steps": 6})), resume=str(two / "checkpoints" / "last.ckpt"))
    got, step = _final_weights(two)
    assert step == 6
    for k in expect:
        assert torch.equal(got[k], expect[k]), k


def test_prepare_only_tokenizes_and_trains_nothing(chat_file, tmp_path):
    out = tmp_path / "prep"
    res = run_module("train.__main__", *tiny_overrides(chat_file, out), "--prepare-only")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "prepared:" in res.stdout
    assert not (out / "checkpoints").exists() and not (out / "export").exists()


def test_predicted_on_several_heldout_sets(chat_file, tmp_path):
    """eval.datasets scores each set's held-out split; the first is the export's promise."""
    from tests.conftest import make_conversations

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(80, seed=5)))
    out = tmp_path / "run"
    run(load_config(None, tiny_overrides(chat_file, out, **{"trainer.max_steps": 2}) + [f"eval.datasets=[{other}, {chat_file}]"]))
    pred = json.loads((out / "predicted.json").read_text())["predicted"]
    assert pred["dataset"] == str(other) and list(pred["also"]) == [chat_file]
    assert pred["num_chains"] > 0 and pred["also"][chat_file]["num_chains"] > 0
    exported = json.loads((out / "export" / "draftsmith.json").read_text())
    assert exported["predicted_acceptance"]["dataset"] == str(other)
    assert pred["also"][chat_file]["sampled"]  # no sampled answers: every set walked at T = 1 on its text

    # with answers sampled at T = 1 for the first set, the other sets promise nothing at T = 1 (a
    # walk of their greedy text at T is not what serving at T sees)
    from data.chat import _is_heldout

    sampled = tmp_path / "sampled.jsonl"
    sampled.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(80, seed=5) if _is_heldout(r["messages"], 0.1)))
    out2 = tmp_path / "run2"
    run(load_config(None, tiny_overrides(chat_file, out2, **{"trainer.max_steps": 2})
                    + [f"eval.datasets=[{other}, {chat_file}]", f"eval.sampled_answers={{1: {sampled}}}"]))
    pred = json.loads((out2 / "predicted.json").read_text())["predicted"]
    assert {e["verification"] for e in pred["sampled"]} == {"standard", "block"}
    assert "sampled" not in pred["also"][chat_file] and pred["also"][chat_file]["num_chains"] > 0


def test_another_eval_set_is_scored_on_every_prompt_training_did_not_see(chat_file, tmp_path, tokenizer):
    """eval.datasets beside the training data: a set of the same questions (answers regenerated)
    keeps only its held-out split; a set of other questions (HumanEval's answered half) is held
    out whole, however its own prompt hashes fall."""
    from data.chat import build_datasets
    from tests.conftest import make_conversations
    from train.run import prepare_data

    same = tmp_path / "same.jsonl"  # the training questions, other answers
    rows = [json.loads(line) for line in open(chat_file)]
    for r in rows:
        r["messages"] = [m if m["role"] == "user" else {**m, "content": m["content"] + " again"} for m in r["messages"]]
    same.write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(40, seed=9)))
    cfg = load_config(None, tiny_overrides(chat_file, tmp_path / "run") + [f"eval.datasets=[{chat_file}, {same}, {other}]"])
    train, heldouts, _, _ = prepare_data(cfg, tokenizer, tokenizer.vocab_size)
    own = heldouts[chat_file]
    assert 0 < len(own) < len(train)
    assert len(heldouts[str(same)]) == len(own)  # the same prompts: the same held-out split
    other_train, other_heldout = build_datasets(str(other), tokenizer, cfg.data.max_length, None, cfg.data.heldout_fraction)
    assert len(other_heldout) < len(other_train)  # its own hash split would keep a few...
    assert len(heldouts[str(other)]) == len(other_train) + len(other_heldout)  # ...but training saw none of them


def test_heldout_split_follows_the_prompt_not_the_answer():
    from data.chat import _is_heldout

    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(400)]
    a = [_is_heldout(p + [{"role": "assistant", "content": "original answer"}], 0.2) for p in prompts]
    b = [_is_heldout(p + [{"role": "assistant", "content": f"regenerated {i}"}], 0.2) for i, p in enumerate(prompts)]
    assert a == b and 0 < sum(a) < 400


def test_the_lr_schedule_ends_with_the_time_budget():
    """optim.schedule_by=time: the cosine follows whichever of steps or time runs out first,
    and the time spent before a resume counts."""
    from train.module import DrafterModule, lr_factor

    assert lr_factor(0, 10, 110, 0.1) == pytest.approx(0.1)  # warm-up
    assert lr_factor(60, 10, 110, 0.1) == pytest.approx(0.55)  # half way by steps
    assert lr_factor(20, 10, 110, 0.1, time_fraction=0.5) == pytest.approx(0.55)  # half way by time
    assert lr_factor(20, 10, 110, 0.1, time_fraction=1.7) == pytest.approx(0.1)  # time is up: the floor
    assert lr_factor(110, 10, 110, 0.1, time_fraction=0.2) == pytest.approx(0.1)  # steps are up

    module = DrafterModule.__new__(DrafterModule)  # only the clock is exercised here
    module.time_budget_s, module._clock, module._seconds_before = 100.0, None, 0.0
    assert module.time_fraction() == 0.0  # before training starts
    module.on_load_checkpoint({"draftsmith_train_seconds": 40.0})  # a resumed run had spent 40 s
    module.on_train_start()
    assert 0.4 <= module.time_fraction() < 0.45
    saved = {}
    module.on_save_checkpoint(saved)
    assert saved["draftsmith_train_seconds"] >= 40.0


def test_eval_temperatures_are_checked(chat_file, tmp_path):
    from train.config import ConfigError

    assert load_config(None, tiny_overrides(chat_file, tmp_path)).eval.temperatures == [0.0, 1.0]
    assert load_config(None, tiny_overrides(chat_file, tmp_path, **{"eval.temperatures": [0, 0.7]})).eval.temperatures == [0, 0.7]
    for bad in ([], [-1.0], [1.0, 1.0], ["hot"]):
        with pytest.raises(ConfigError, match="eval.temperatures"):
            load_config(None, tiny_overrides(chat_file, tmp_path, **{"eval.temperatures": bad}))
    # answers sampled at T, for the promise at T: keys are temperatures > 0 the promise is made for
    assert load_config(None, tiny_overrides(chat_file, tmp_path) + ["eval.sampled_answers={1: a.jsonl}"]
                       ).eval.sampled_answers == {1.0: "a.jsonl"}
    for bad, why in (("{0: a.jsonl}", "serve no promise"), ("{0.7: a.jsonl}", "serve no promise"),
                     ("{hot: a.jsonl}", "keys are numbers"), ("[a.jsonl]", "expected a mapping")):
        with pytest.raises(ConfigError, match=f"eval.sampled_answers.*{why}"):
            load_config(None, tiny_overrides(chat_file, tmp_path) + [f"eval.sampled_answers={bad}"])


def test_a_rehearsal_keeps_nothing_so_the_real_run_can_follow(chat_file, tmp_path):
    """fast_dev_run goes end to end in a temporary folder: out_dir stays absent, and a run
    launched next into it is not refused as 'already holds a run'."""
    out = tmp_path / "run"
    run(load_config(None, tiny_overrides(chat_file, out, **{"trainer.fast_dev_run": True})))
    assert not out.exists()
    run(load_config(None, tiny_overrides(chat_file, out, **{"trainer.max_steps": 1})))
    assert (out / "export" / "config.json").is_file()


def test_a_training_step_reads_nothing_back_from_the_device(chat_file, tmp_path, monkeypatch):
    # a value read back inside the step makes the host wait for the device there: the host then
    # cannot queue step n+1 while the device runs step n (issue 20's drafter trains in one call).
    # Counted: the step itself, and what Lightning and the callbacks do after each batch (Lightning
    # reads back every value logged with prog_bar=True there, whether or not a bar is shown)
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    import train.callbacks as callbacks
    from tests.conftest import device_reads
    from train.callbacks import ProgressBar, Throughput
    from train.module import DrafterModule

    reads, steps = [], []

    def counted(cls, name, record=None):
        real = getattr(cls, name)

        def wrapper(*args, **kwargs):
            out, found = device_reads(lambda: real(*args, **kwargs))
            reads.extend((len(steps), f"{cls.__name__}.{name}", op) for op in found)
            if record is not None:
                record.append(1)
            return out

        monkeypatch.setattr(cls, name, wrapper)

    counted(DrafterModule, "training_step", steps)
    counted(_LoggerConnector, "on_batch_end")
    counted(ProgressBar, "on_train_batch_end")
    counted(Throughput, "on_train_batch_end")
    monkeypatch.setattr(callbacks, "progress_refresh_rate", lambda: 1000)  # a GPU's bar: it refreshes rarely
    monkeypatch.setattr(Throughput, "__init__", lambda self, warmup=1, every=2, _init=Throughput.__init__: _init(self, warmup, every))
    monkeypatch.setattr(Throughput, "_sync", staticmethod(lambda: None))
    run(load_config(None, tiny_overrides(chat_file, tmp_path / "run", **{
        "trainer.max_steps": 4, "eval.every_n_steps": 100, "trainer.enable_progress_bar": True,
        "trainer.log_every_n_steps": 1000})))
    assert len(steps) == 4
    # the only reads: the bar's refresh at the epoch's last batch (loss and accuracy shown)
    assert reads == [(4, "ProgressBar.on_train_batch_end", "_local_scalar_dense")] * 2, reads


def test_throughput_syncs_once_a_window_and_counts_every_timed_token(monkeypatch):
    from train.callbacks import Throughput

    syncs = []
    monkeypatch.setattr(Throughput, "_sync", staticmethod(lambda: syncs.append(1)))
    meter = Throughput(warmup=5, every=50)

    class Module:
        logged = {}

        def log(self, name, value, **_):
            self.logged[name] = value

    module = Module()
    for i in range(130):
        if i == 80:  # a validation in the middle: the open window closes there
            meter.on_validation_start(None, module)
        batch = {"num_tokens": i + 1}
        meter.on_train_batch_start(None, module, batch, i)
        meter.on_train_batch_end(None, module, None, batch, i)
    meter.on_train_end(None, module)
    # windows: steps 6-55 (closed after 50), 56-80 (closed by the validation), 81-130 (50)
    assert len(syncs) == 6
    assert meter.tokens == sum(range(6, 131))
    assert module.logged["train/tokens_per_s"] > 0
