import json

import pytest
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
                 "--tree", "2,1,2", "--tree", "2,2,3,1", "--out", str(out)]) == 0
    summary = json.loads((out / "bench.json").read_text())
    rows = summary["rows"]
    assert {"transformers generate", "transformers prompt lookup", "runtime plain", "runtime n-gram (k=4)",
            "runtime EAGLE-3 (k=2)", "runtime EAGLE-3 (k=4)", "runtime Medusa (k=2)", "runtime plain, batch 2",
            "runtime EAGLE-3 (k=2), batch 2", "runtime Medusa (k=2), batch 2",
            "runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)", "runtime suffix (k=4)"} <= set(rows)
    assert rows["runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)"]["verify_tokens_per_step"] == 5
    # the root's 2 children, each expanded into 1: 4 candidates, 3 kept
    assert rows["runtime EAGLE-3 tree (depth 2, top-k 2, 1 child, 3 nodes)"]["verify_tokens_per_step"] == 4
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
    # the sweep's fastest tree, beside the same drafter's chain at its depth (k=2)
    best = summary["best_tree"]
    trees = {(2, 2, 4): rows["runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)"],
             (2, 1, 2): rows["runtime EAGLE-3 tree (depth 2, top-k 1, 2 nodes)"],
             (2, 2, 3, 1): rows["runtime EAGLE-3 tree (depth 2, top-k 2, 1 child, 3 nodes)"]}
    fastest = max(trees, key=lambda t: trees[t]["tokens_per_s"])
    assert tuple(best["tree"].values()) == fastest and best["tokens_per_s"] == trees[fastest]["tokens_per_s"]
    assert best["chain"]["row"] == "runtime EAGLE-3 (k=2)" and best["chain"]["verify_tokens_per_step"] == 3
    assert best["verify_tokens_per_step"] == fastest[2] + 1 and len(best["swept"]) == 3
    assert best["device"] == "cpu" and best["target"] == "tiny-random-llama"
    # the kernel settings are recorded: the mode, for the run and each row, and the tree-attention
    # tuning in --tree-attention's form (here the defaults)
    from draftsmith_kernels.settings import TreeAttentionTuning
    assert summary["kernels"] == "auto" and TreeAttentionTuning.parse(summary["tree_attention"]) == TreeAttentionTuning()
    assert rows["runtime plain, torch ops (--kernels off)"]["kernels"] == "off" and rows["runtime plain"]["kernels"] == "auto"
    assert rows["transformers generate"]["kernels"] is None


def test_bench_kernel_flags_are_checked_before_any_model_loads(tmp_path, capsys):
    """A bad --tree-attention or --kernels is one error line and exit code 2, nothing written."""
    out = tmp_path / "bench"
    assert main(["--tree-attention", "num_warps=3", "--device", "cpu", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: --tree-attention: tree attention: num_warps=3 is not one of 1, 2, 4, 8"
    with pytest.raises(SystemExit) as exit_:
        main(["--kernels", "on", "--device", "cpu", "--out", str(out)])
    assert exit_.value.code == 2 and "--kernels" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_bench_graphs_the_tree_by_default_on_a_gpu(tmp_path):
    """`python -m inference.bench --tree ...` as the README gives it, with nothing set beyond its
    command line: on a GPU the tree row replays CUDA graphs as the chain rows do, through the
    kernels, and bench.json says so."""
    out = tmp_path / "bench"
    eagle3 = _random_exports(tmp_path)[0]
    assert main(["--target", "tiny-random-llama", "--num-prompts", "2", "--max-new-tokens", "8", "--device", "cuda",
                 "-k", "2", "--drafter", eagle3, "--hf-prompts", "1", "--tree", "2,2,4", "--out", str(out)]) == 0
    summary = json.loads((out / "bench.json").read_text())
    rows = summary["rows"]
    tree, chain = rows["runtime EAGLE-3 tree (depth 2, top-k 2, 4 nodes)"], rows["runtime EAGLE-3 (k=2)"]
    assert tree["split"]["device_loop"] and tree["split"]["graphed"] and tree["kernels"] == "auto"
    assert chain["split"]["graphed"] and rows["runtime plain"]["split"]["graphed"]
    assert summary["kernels"] == "auto"


def test_best_tree_is_the_fastest_swept_beside_the_chain_at_its_depth():
    from inference.bench import best_tree_setting

    def row(tps, tau, verify):
        return {"tokens_per_s": tps, "acceptance": {"tau": tau}, "verify_tokens_per_step": verify, "vs_runtime_plain": tps / 10}

    rows = {"runtime plain": {"tokens_per_s": 10.0, "verify_tokens_per_step": None},
            "runtime EAGLE-3 (k=3)": row(20.0, 2.0, 4), "runtime EAGLE-3 (k=5)": row(24.0, 2.4, 6),
            "runtime EAGLE-3 tree (depth 3, top-k 2, 8 nodes)": row(30.0, 2.9, 9),
            "runtime EAGLE-3 tree (depth 4, top-k 4, 24 nodes)": row(26.0, 3.4, 25),
            "runtime EAGLE-3 tree (depth 5, top-k 2, 12 nodes)": row(30.0, 3.0, 13)}
    trees = [(4, 4, 24), (3, 2, 8), (5, 2, 12)]
    best = best_tree_setting(rows, trees, [3, 5], "t", "H200")
    # highest tok/s; the tie at 30 goes to the first given; the chain at its depth
    assert best["tree"] == {"depth": 3, "top_k": 2, "total_tokens": 8} and best["verify_tokens_per_step"] == 9
    assert best["chain"]["k"] == 3 and best["chain"]["verify_tokens_per_step"] == 4
    assert best["tree_vs_chain"]["tokens_per_s"] == pytest.approx(1.5) and best["tree_vs_chain"]["tau"] == pytest.approx(1.45)
    assert [s["tree"] for s in best["swept"]] == [[4, 4, 24], [3, 2, 8], [5, 2, 12]]
    # no chain at the tree's depth: the drafter's fastest chain stands beside it
    assert best_tree_setting(rows, [(5, 2, 12)], [3, 5], "t", "H200")["chain"]["k"] == 5
    assert best_tree_setting(rows, [(2, 2, 4)], [3], "t", "H200") is None  # no tree row measured


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


def test_bench_repeats_time_every_runtime_row_in_turn_and_keep_the_median(tiny_target, tmp_path, capsys):
    """--repeats 3: every runtime row timed three times, pass by pass (each pass every row in
    turn); a row's tok/s is its median pass, its passes kept beside it; transformers' rows run
    once. --repeats 0 is refused with one line."""
    out = tmp_path / "bench"
    assert main(["--target", "tiny-random-llama", "--num-prompts", "2", "--max-new-tokens", "4", "--device", "cpu",
                 "-k", "2", "--hf-prompts", "1", "--repeats", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "bench.json").read_text())["rows"]
    for name, r in rows.items():
        if not name.startswith("runtime"):
            assert "tokens_per_s_passes" not in r, name
            continue
        passes = r["tokens_per_s_passes"]
        assert len(passes) == 3 and sorted(passes)[1] == r["tokens_per_s"], name
        assert r["outputs_equal_runtime_plain"] == r["prompts"], name
    # pass 2 starts after pass 1 has timed every row (transformers' too), pass 3 after pass 2's runtime rows
    order = [line.split(": ", 1)[0] for line in printed.splitlines() if line.startswith("pass ")]
    runtime_rows = [n for n in rows if n.startswith("runtime")]
    assert order == ["pass 1/3"] * len(rows) + ["pass 2/3"] * len(runtime_rows) + ["pass 3/3"] * len(runtime_rows)
    assert main(["--repeats", "0", "--out", str(tmp_path / "b0")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--repeats" in err and len(err.splitlines()) == 1
