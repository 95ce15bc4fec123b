import json

import torch

from inference.bench import main


def _random_exports(tmp_path):
    """An EAGLE-3 and a Medusa export of random drafters for the tiny target (mechanics only)."""
    from transformers import AutoModelForCausalLM

    from export.medusa import export_medusa
    from export.speculators import export_speculators
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.zoo import resolve_target

    hf = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-random-llama"), dtype=torch.float32)
    V = hf.config.vocab_size
    keep = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    torch.manual_seed(0)
    eagle = Eagle3Drafter(Eagle3Config.from_target(hf.config, V))
    medusa = MedusaDrafter(MedusaConfig.from_target(hf.config, V, num_heads=3))
    for d in (eagle, medusa):
        d.init_from_target(hf, *keep)
    export_speculators(eagle, tmp_path / "eagle3", target_name="tiny-random-llama", target_arch=["LlamaForCausalLM"], k=4,
                       dtype=torch.float32)
    export_medusa(medusa, tmp_path / "medusa", target_name="tiny-random-llama", dtype=torch.float32)
    return [str(tmp_path / "eagle3"), str(tmp_path / "medusa")]


def test_bench_writes_json_and_chart(tiny_target, tmp_path):
    out = tmp_path / "bench"
    drafters = _random_exports(tmp_path)
    assert main(["--target", "tiny-random-llama", "--num-prompts", "4", "--max-new-tokens", "6", "--device", "cpu",
                 "-k", "2", "4", "--drafter", *drafters, "--batch-size", "2", "--hf-prompts", "1", "--tree", "2,2,4",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "bench.json").read_text())
    rows = summary["rows"]
    assert {"transformers generate", "transformers prompt lookup", "runtime plain", "runtime n-gram (k=4)",
            "runtime EAGLE-3 (k=2)", "runtime EAGLE-3 (k=4)", "runtime Medusa (k=2)", "runtime plain, batch 2",
            "runtime EAGLE-3 (k=2), batch 2", "runtime Medusa (k=2), batch 2",
            "runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)"} <= set(rows)
    assert rows["runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)"]["verify_tokens_per_step"] == 5
    assert rows["runtime EAGLE-3 (k=4)"]["verify_tokens_per_step"] == 5
    assert "runtime Medusa (k=4)" not in rows  # three heads draft at most three tokens
    assert rows["transformers generate"]["prompts"] == 1 and rows["runtime plain"]["prompts"] == 4
    for name, r in rows.items():
        if name.startswith("runtime"):
            assert r["outputs_equal_runtime_plain"] == r["prompts"], name  # float32: speculative output is exact
            assert r["tokens_per_s"] > 0
            split = r["split"]
            assert split["draft_ms_per_step"] >= 0 and split["verify_ms_per_step"] > 0, name
            assert 0 < split["host_syncs_per_token"] <= 3, name
    assert rows["runtime EAGLE-3 (k=4)"]["split"]["device_loop"] and not rows["runtime n-gram (k=4)"]["split"]["device_loop"]
    assert rows["runtime EAGLE-3 (k=2), batch 2"]["vs_runtime_plain_same_batch"] > 0
    assert "acceptance" in rows["runtime n-gram (k=4)"]
    assert (out / "bench.png").stat().st_size > 1000


def test_bench_chart_labels_stay_inside_the_figure(tmp_path):
    """Every bar label ends left of the figure's right edge (bench.png once cut them off)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from inference import bench

    rows = {f"runtime some proposer with a long name (k={k})": {"tokens_per_s": 100.0 * k, "vs_runtime_plain_same_batch": k / 2,
                                                                "acceptance": {"tau": 2.5}} for k in range(1, 9)}
    summary = {"target": "t", "prompts": "p", "num_prompts": 1, "device": "cpu", "rows": rows}
    saved = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *a, **kw):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        width = fig.bbox.width
        saved.append([t.get_window_extent(renderer).x1 <= width for t in fig.axes[0].texts])
        return real_savefig(fig, *a, **kw)

    plt.Figure.savefig = spy
    try:
        bench._chart(summary, tmp_path / "b.png")
    finally:
        plt.Figure.savefig = real_savefig
    assert saved and saved[0] and all(saved[0])


def test_bench_refuses_a_folder_that_is_not_an_export(tmp_path, capsys):
    assert main(["--drafter", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "is not an export folder" in capsys.readouterr().err
