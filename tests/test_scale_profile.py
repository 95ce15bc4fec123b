"""scripts/scale_profile.py rehearsed on a CPU with a tiny --hf-config: every part a CPU runs,
the files' structure (benchmarks.csv's columns), and each floor and ratio computed from the
measured numbers it names; bad input refused before anything is written."""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import torch

from scripts import scale_profile
from scripts.scale_shapes import eagle3_draft_read_bytes, load_hf_config, random_eagle3, random_runtime, target_read_bytes

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": True}
FAST = ["--device", "cpu", "--dtype", "float32", "--draft-vocab", "128", "--prompts", "1", "--prompt-len", "12",
        "--max-new", "6", "--plain-steps", "2", "--plain-cache", "64", "--copy-mib", "2", "--train-seq", "24",
        "--train-steps", "1", "--tree", "2,2,4"]


def _config(tmp_path, **changes) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9)


def test_cpu_rehearsal_records_every_part_with_floors_from_measured_numbers(tmp_path, capsys):
    out = tmp_path / "out"
    scale_profile.main(["--hf-config", str(_config(tmp_path)), "--out", str(out), *FAST])
    printed = capsys.readouterr().out
    assert "tiny] hf: skipped" in printed and "tiny:\n  plain step" in printed and "  EAGLE-3 k=7: draft" in printed
    report = json.loads((out / "scale_profile.json").read_text())
    assert report["tool"] == "scripts/scale_profile.py" and report["gpu"] == "cpu" and report["cut"] == []
    assert "--hf-config" in report["command"] and report["settings"]["rate"] == 0.75
    tiny = report["shapes"]["tiny"]
    assert set(tiny) == {"weights", "plain", "eagle3_chain_k2", "eagle3_chain_k4", "eagle3_chain_k7", "tree_2_2_4",
                         "train_eagle3", "train_dflash", "hf_static_compiled"}
    assert tiny["hf_static_compiled"] == {"skipped": "needs CUDA"}

    w, plain = tiny["weights"], tiny["plain"]
    bw = w["bandwidth_tb_s"] * 1e12
    # the tiny target's weights, counted here from its shape: tied head, so a step reads them all
    H, I, V, L, d = 32, 64, 512, 2, 8
    layer = (2 * H + H * (4 + 2 + 2) * d + 4 * d * H + 2 * I * H + I * H) * 4  # norms, qkv, o, gate_up, down (fp32)
    assert w["read_bytes"] == w["all_weight_bytes"] == L * layer + H * 4 + V * H * 4
    assert close(w["floor_ms"], 1e3 * w["read_bytes"] / bw)
    assert close(plain["x_floor"], plain["step_ms"] / w["floor_ms"]) and plain["step_ms"] > 0
    assert close(plain["tok_s"], plain["generate"]["tokens"] / plain["generate"]["seconds"])
    for k in (2, 4, 7):
        r = tiny[f"eagle3_chain_k{k}"]
        # EAGLE-3 layer over [embedding; hidden]: three norms, qkv from 2H, o, the MLP
        d_layer = (3 * H + 2 * H * (4 + 2 + 2) * d + 4 * d * H + 3 * I * H) * 4
        # fc over the 2 aux layers a 2-layer target has (models/eagle3.py default_aux_layer_ids), its norm
        assert (r["fc_bytes"], r["layer_bytes"], r["head_bytes"]) == ((2 * H + 2 * H * H) * 4, d_layer, (H + 128 * H) * 4)
        assert r["bytes"] == r["fc_bytes"] + k * (r["layer_bytes"] + r["head_bytes"])
        assert close(r["draft_floor_ms"], 1e3 * r["bytes"] / bw)
        assert close(r["draft_x_floor"], r["draft_ms"] / r["draft_floor_ms"])
        assert close(r["draft_x_whole_passes"], r["draft_ms"] * bw / 1e3 / ((k + 1) * (r["fc_bytes"] + d_layer + r["head_bytes"])))
        assert close(r["verify_x_plain"], r["verify_ms"] / plain["step_ms"])
        assert close(r["x_plain"], r["tok_s"] / plain["tok_s"])
        assert close(r["draft_ms"], 1e3 * r["draft_s"] / r["steps"]) and r["draft_ms"] > 0
        assert 1 <= r["tau"] <= k + 1
    tree = tiny["tree_2_2_4"]
    assert close(tree["verify_x_plain"], tree["verify_ms"] / plain["step_ms"]) and tree["nodes"] == 4
    for method, steps in (("eagle3", 7), ("dflash", 7)):
        t = tiny[f"train_{method}"]
        assert t["ttt"] == steps and t["seq"] == 24 and t["draft_vocab"] == 128 and t["peak_gib"] is None
        assert close(t["tokens_s"], 24 / (t["ms"]["total"] / 1e3))

    # the CSV: benchmarks.csv's columns, one row per figure, values as the JSON's (5 significant digits)
    with open(ROOT / "benchmarks.csv", newline="") as f:
        columns = next(csv.reader(f))
    with open(out / "scale_profile.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == columns
        rows = {r["measure"]: r for r in reader}
    assert rows.keys() == {r["measure"] for r in report["rows"]}
    for row in rows.values():
        assert row["measure"].startswith("scale.tiny.") and row["gpu"] == "cpu" and row["log_line"] == ""
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]) and "scale_profile.py" in row["command"]
        assert re.fullmatch(r"[0-9a-f]{7,40}|not recorded", row["commit"])
        float(row["value"])
    for measure, value in (("plain.x_floor", plain["x_floor"]), ("eagle3_chain_k4.draft_x_floor", tiny["eagle3_chain_k4"]["draft_x_floor"]),
                           ("train_dflash.tokens_s", tiny["train_dflash"]["tokens_s"]), ("copy_bandwidth", w["bandwidth_tb_s"])):
        assert math.isclose(float(rows[f"scale.tiny.{measure}"]["value"]), value, rel_tol=1e-4), measure
    assert "scale.tiny.train_eagle3.peak_gib" not in rows  # no peak memory measured on a CPU: no row


def test_untied_target_reads_its_head_not_its_embedding_table(tmp_path):
    rt = random_runtime(load_hf_config(str(_config(tmp_path, tie_word_embeddings=False))), "cpu", torch.float32)
    read, every = target_read_bytes(rt)
    assert every - read == 512 * 32 * 4 and rt.lm_head.weight is not rt.embed_tokens.weight
    drafter = random_eagle3(load_hf_config(str(_config(tmp_path))), 100, "cpu", torch.float32)
    assert drafter.draft_ids().tolist() == list(range(100)) and int(drafter.t2d.sum()) == 100
    assert eagle3_draft_read_bytes(drafter, 3)["head_bytes"] == (32 + 100 * 32) * 4


def test_a_qwen3_config_runs_its_plain_part(tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "qwen3-tiny.json"
    config.write_text(json.dumps({**TINY, "model_type": "qwen3", "tie_word_embeddings": False}))
    scale_profile.main(["--hf-config", str(config), "--out", str(out), "--parts", "plain", *FAST])
    shape = json.loads((out / "scale_profile.json").read_text())["shapes"]["qwen3-tiny"]
    assert set(shape) == {"weights", "plain"}
    # per-head q/k norms (2 x d per layer) read too; the untied embedding table not
    w = shape["weights"]
    assert w["all_weight_bytes"] - w["read_bytes"] == 512 * 32 * 4
    assert w["read_bytes"] == 2 * (2 * 32 + 2 * 8 + 32 * 64 + 32 * 32 + 3 * 64 * 32) * 4 + 32 * 4 + 512 * 32 * 4


def test_budget_cuts_parts_and_says_so(tmp_path):
    out = tmp_path / "out"
    scale_profile.main(["--hf-config", str(_config(tmp_path)), "--out", str(out), "--budget-s", "0",
                        "--parts", "plain,train,hf", *FAST])
    report = json.loads((out / "scale_profile.json").read_text())
    assert report["cut"] == ["tiny runtime", "tiny train", "tiny hf"] and report["rows"] == []


@pytest.mark.parametrize("extra, says", [
    (["--hf-config", "/nonexistent/config.json"], "not a readable JSON file"),
    (["--parts", "plain,fast"], "--parts: fast"),
    (["--shapes", "llama-70b"], "--shapes: llama-70b"),
    (["--tree", "6,10"], "--tree"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, extra, says):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        scale_profile.main(["--out", str(out), *FAST, *extra])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1
    assert not out.exists()


def test_a_foreign_file_in_out_is_not_replaced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "scale_profile.json").write_text('{"mine": 1}')
    (tmp_path / "qwen.json").write_text(json.dumps({**TINY, "model_type": "mamba"}))
    for config, says in ((_config(tmp_path), "not written by"), (tmp_path / "qwen.json", "model_type 'mamba'")):
        with pytest.raises(SystemExit):
            scale_profile.main(["--hf-config", str(config), "--out", str(out), *FAST])
        assert says in capsys.readouterr().err
    assert (out / "scale_profile.json").read_text() == '{"mine": 1}' and not (out / "scale_profile.csv").exists()
