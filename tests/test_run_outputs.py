"""What training and export do to folders that already exist: resume keeps history, an
interruption says how to continue, --overwrite and --force replace only what is ours, killed
writes leave nothing behind; and targets without a chat template train (template file, plain text)."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from tests.conftest import interrupt_training_at, tiny_overrides


def _overrides(chat_file, out, **extra):
    """The tiny run with its CSV log on (tiny_overrides turns loggers off for speed)."""
    return [o for o in tiny_overrides(chat_file, out, **extra) if not o.startswith("trainer.logger=")]


def _steps_logged(out) -> list[int]:
    with open(out / "logs" / "metrics.csv", newline="") as f:
        return sorted({int(r["step"]) for r in csv.DictReader(f)})


def test_resume_continues_the_metrics_and_keeps_every_checkpoint(chat_file, tmp_path):
    from train.__main__ import main

    out = tmp_path / "run"
    base = _overrides(chat_file, out, **{"checkpoint_every_n_steps": 1, "trainer.log_every_n_steps": 1,
                                         "optim.schedule_steps": 4})
    assert main(base + ["trainer.max_steps=2"]) == 0
    first = _steps_logged(out)
    assert main(base + ["trainer.max_steps=4", "--resume"]) == 0
    steps = _steps_logged(out)
    assert set(first) <= set(steps) and max(steps) > max(first)  # the earlier rows survive
    kept = sorted(p.name for p in (out / "checkpoints").glob("step*.ckpt"))
    assert kept == ["step1.ckpt", "step2.ckpt", "step3.ckpt", "step4.ckpt"]
    for path in (out / "checkpoints").glob("*.ckpt"):  # before and after the resume, each describes itself
        assert torch.load(path, weights_only=True)["draftsmith"]["method"] == "eagle3", path.name


def test_ctrl_c_prints_the_command_that_resumes(chat_file, tmp_path, monkeypatch, capsys):
    import shlex

    from train.__main__ import main

    out = tmp_path / "run"
    argv = tiny_overrides(chat_file, out, **{"checkpoint_every_n_steps": 2})
    restore = interrupt_training_at(monkeypatch, 2)
    assert main(argv + ["--overwrite"]) == 130
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("interrupted at step 2"))
    assert "last.ckpt" in line
    command = line.split("continue with: ", 1)[1]
    assert command.startswith("python -m train ") and command.endswith("--resume") and "--overwrite" not in command
    restore()
    assert main(shlex.split(command)[3:]) == 0  # the printed command, as typed
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert "draftsmith" in torch.load(out / "checkpoints" / "step2.ckpt", weights_only=True)  # saved before Ctrl-C


def test_a_killed_checkpoint_write_is_cleaned_on_the_next_run(chat_file, tmp_path):
    from train.__main__ import main

    out = tmp_path / "run"
    base = tiny_overrides(chat_file, out, **{"optim.schedule_steps": 4})
    assert main(base + ["trainer.max_steps=2"]) == 0
    stale = out / "checkpoints" / ".last.ckpt.tmp-999999999"  # no such process
    stale.write_bytes(b"")
    assert main(base + ["trainer.max_steps=3", "--resume"]) == 0
    assert not stale.exists()


def test_overwrite_replaces_the_run_and_nothing_else(chat_file, tmp_path):
    from train.__main__ import main

    out = tmp_path / "run"
    base = tiny_overrides(chat_file, out, **{"trainer.max_steps": 2})
    assert main(base) == 0
    notes = out / "notes.txt"
    notes.write_text("mine")
    old = (out / "checkpoints" / "last.ckpt").read_bytes()
    assert main(base + ["seed=1"]) == 2  # refused without a flag
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == old
    assert main(base + ["seed=1", "--overwrite"]) == 0
    assert notes.read_text() == "mine" and (out / "checkpoints" / "last.ckpt").read_bytes() != old
    assert "seed: 1" in (out / "config.yaml").read_text()


def test_export_force_replaces_only_an_export_and_says_so(chat_file, tmp_path, capsys):
    from export.__main__ import main as export_main
    from train.__main__ import main

    run = tmp_path / "run"
    assert main(tiny_overrides(chat_file, run, **{"trainer.max_steps": 2})) == 0
    out = tmp_path / "exported"
    args = ["--checkpoint", str(run), "--format", "speculators", "--out", str(out)]
    assert export_main(args) == 0
    before = (out / "model.safetensors").read_bytes()
    assert export_main(args + ["--dtype", "float32"]) == 2  # an export is replaced only when asked
    assert (out / "model.safetensors").read_bytes() == before
    capsys.readouterr()
    assert export_main(args + ["--dtype", "float32", "--force"]) == 0
    assert "replacing the draftsmith export at" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() != before  # float32 now


def test_a_hostile_checkpoint_runs_no_code(tmp_path):
    """torch.load(weights_only=False) would run this pickle's code; load_checkpoint refuses it."""
    from train.checkpoint_io import CheckpointError, load_checkpoint

    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": RunsCode()}, path)
    with pytest.raises(CheckpointError, match="refusing to load it"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.fixture()
def no_template_target(tiny_target, tmp_path):
    import shutil
    from pathlib import Path

    folder = tmp_path / "base-model"
    shutil.copytree(tiny_target, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(folder).chat_template
    return Path(folder)


def test_a_target_without_chat_template_trains_with_a_template_file_or_on_plain_text(chat_file, tmp_path,
                                                                                     no_template_target, capsys):
    from train.__main__ import main

    base = {"target": str(no_template_target), "trainer.max_steps": 2}
    assert main(tiny_overrides(chat_file, tmp_path / "refused", **base)) == 2
    assert "has no chat template; set data.chat_template" in capsys.readouterr().err
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert main(tiny_overrides(chat_file, tmp_path / "templated", **base, **{"data.chat_template": str(template)})) == 0
    assert (tmp_path / "templated" / "export" / "model.safetensors").is_file()

    texts = tmp_path / "texts.jsonl"
    words = "a base model reads plain text and predicts every next token of it".split()
    texts.write_text("".join(json.dumps({"text": f"text {i}: " + " ".join(words[i % 7:] + words[: i % 7]) * 3}) + "\n"
                             for i in range(80)))
    out = tmp_path / "plain"
    assert main(tiny_overrides(str(texts), out, **base, **{"data.plain_text": True})) == 0
    predicted = json.loads((out / "predicted.json").read_text())["predicted"]
    assert predicted["num_chains"] > 0


def test_plain_text_puts_the_loss_on_every_token_after_the_first(tokenizer):
    from data.templates import tokenize_text

    row = tokenize_text(tokenizer, "one two three four", max_length=64)
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert row["loss_mask"] == [0] + [1] * (len(row["input_ids"]) - 1)
