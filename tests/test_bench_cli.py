import json

from inference.bench import main


def test_bench_writes_json_and_chart(tiny_target, tmp_path):
    out = tmp_path / "bench"
    assert main(["--target", "tiny-random-llama", "--num-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "bench.json").read_text())
    rows = summary["rows"]
    assert {"transformers generate", "transformers prompt lookup", "runtime plain", "runtime n-gram (k=4)"} <= set(rows)
    for name in ("runtime plain", "runtime n-gram (k=4)"):
        assert rows[name]["outputs_equal_runtime_plain"] == 2  # float32: speculative output is exact
        assert rows[name]["tokens_per_s"] > 0
    assert "acceptance" in rows["runtime n-gram (k=4)"]
    assert (out / "bench.png").stat().st_size > 1000


def test_bench_refuses_a_folder_that_is_not_an_export(tmp_path, capsys):
    assert main(["--drafter", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "is not an export folder" in capsys.readouterr().err
