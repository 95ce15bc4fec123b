"""The measurement scripts the device sessions run: scripts/compare_exports.py (issue 22's
plain-against-FSDP check), scripts/trace_kernels.py (a profiler trace kernel by kernel) and the
others below (bench_gemm.py's Triton tiles, acceptance by offset, the tree sweep, train_ab.sh,
kernel_registers.py's compile for an H200 without one)."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from scripts.compare_exports import main as compare_exports
from scripts.trace_kernels import main as trace_kernels


def test_compare_exports_passes_bf16_noise_and_names_a_tensor_over_the_tolerance(tmp_path, capsys):
    a, b, c = (tmp_path / n for n in "abc")
    for folder in (a, b, c):
        folder.mkdir()
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    save_file({"fc.weight": w, "ids": torch.arange(3)}, a / "model.safetensors")
    save_file({"fc.weight": w + 0.01, "ids": torch.arange(3)}, b / "model.safetensors")
    save_file({"fc.weight": w + 0.5, "ids": torch.arange(3)}, c / "model.safetensors")
    assert compare_exports([str(a), str(b)]) == 0
    assert compare_exports([str(a), str(c)]) == 1 and "over 0.02: ['fc.weight']" in capsys.readouterr().out
    assert compare_exports([str(a), str(tmp_path / "none")]) == 2


def test_trace_kernels_sums_kernels_and_gaps_inside_a_named_range(tmp_path, capsys):
    events = [{"cat": "user_annotation", "name": "draftsmith.proposer_begin", "ts": 0, "dur": 100},
              {"cat": "user_annotation", "name": "draftsmith.loop_run", "ts": 200, "dur": 1000},
              {"cat": "kernel", "name": "_rms_norm_kernel", "ts": 10, "dur": 2},
              {"cat": "kernel", "name": "gemv", "ts": 50, "dur": 5},  # a 38 µs gap: the GPU waited for the host
              {"cat": "kernel", "name": "gemv", "ts": 300, "dur": 4}]  # in the next range: left out
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace_kernels([str(path), "--range", "draftsmith.proposer_begin"])
    out = capsys.readouterr().out
    assert out.startswith("2 kernels, 0.007 ms busy of 0.045 ms") and "gaps >= 20 µs: 1, 0.038 ms" in out
    assert "      1        5.0     5.00  gemv" in out


def test_acceptance_by_offset_buckets_held_out_and_served_chains(chat_file, tmp_path):
    from scripts.acceptance_by_offset import main as by_offset
    from tests.conftest import tiny_overrides
    from train.config import load_config
    from train.run import run

    run(load_config(None, tiny_overrides(chat_file, tmp_path / "run", **{"trainer.max_steps": 2})))
    out = tmp_path / "offsets.json"
    assert by_offset([str(tmp_path / "run" / "export"), "--dataset", chat_file, "--num-prompts", "4", "--max-new-tokens", "8",
                      "--heldout-sequences", "4", "--device", "cpu", "--batch-size", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    served, held = result[chat_file], result["held-out"]
    assert served["1"]["all"][1] > 0 and held["1"]["all"][1] > 0
    # served answers stop at 8 tokens: every chain starts in the first bucket, all of them before token 8
    assert list(served["1"]["buckets"]) == ["0-31"] and served["1"]["before 8"] == served["1"]["all"]
    for turn in held.values():  # chains are counted once: the buckets add up to the whole
        assert sum(n for _, n in turn["buckets"].values()) == turn["all"][1] >= turn["before 8"][1]


def test_sweep_trees_walks_the_runtimes_own_chains_and_reuses_its_answers(chat_file, tmp_path, capsys, monkeypatch):
    import inference.served
    from scripts.sweep_trees import main as sweep
    from tests.conftest import tiny_overrides
    from train.config import load_config
    from train.run import run

    run(load_config(None, tiny_overrides(chat_file, tmp_path / "run", **{"trainer.max_steps": 2})))
    export, answers, rows = str(tmp_path / "run" / "export"), tmp_path / "answers.json", tmp_path / "rows.json"
    args = [export, "--chains", "1,3", "--tree", "2,2,4", "--dataset", chat_file, "--num-prompts", "3",
            "--max-new-tokens", "12", "--answers", str(answers), "--json", str(rows)]
    assert sweep(args) == 0
    first = json.loads(rows.read_text())
    assert [r["shape"] for r in first["rows"]] == ["chain k=1", "chain k=3", "tree 2-2-4"]
    # float32 greedy: the walk at the served k drafts the very chains the runtime drafted
    assert first["served"]["k"] == 3 and first["rows"][1]["histogram"] == first["served"]["histogram"]
    assert all(r["steps"] == sum(r["histogram"]) > 0 for r in first["rows"])

    def never(*a, **k):
        raise AssertionError("served again although the answers were kept")
    monkeypatch.setattr(inference.served, "measure", never)
    assert sweep(args) == 0 and json.loads(rows.read_text()) == first
    assert "3 answers read from" in capsys.readouterr().out
    # the kept answers serve another drafter of the target too; the runtime's chains were not its own
    import shutil
    shutil.copytree(export, tmp_path / "other")
    assert sweep([str(tmp_path / "other")] + args[1:]) == 0 and "runtime's chains" not in capsys.readouterr().out
    assert json.loads(rows.read_text()) == {"served": None, "rows": first["rows"]}
    assert sweep([export, "--tree", "2,2,99"]) == 2  # more nodes than a depth-2, top-2 tree drafts
    assert sweep([str(tmp_path), "--chains", "2"]) == 2 and "no draftsmith.json" in capsys.readouterr().err
    (tmp_path / "notes.json").write_text('["mine"]')
    assert sweep([export, "--answers", str(tmp_path / "notes.json")]) == 2
    assert "not answers this script wrote" in capsys.readouterr().err and (tmp_path / "notes.json").read_text() == '["mine"]'


def test_train_ab_times_each_checkout_on_the_loops_own_clock(chat_file, tmp_path):
    import os
    import subprocess

    from tests.conftest import tiny_overrides

    extra = [a for a in tiny_overrides(chat_file, tmp_path / "unused", **{"trainer.max_steps": 3})
             if not a.startswith(("out_dir=", "data.dataset=", "trainer.max_steps="))]
    env = {**os.environ, "DATA": chat_file, "LOGS": str(tmp_path / "logs"), "RUNS_DIR": str(tmp_path),
           "TRAIN_ARGS": " ".join(extra)}
    # one variant, from a folder (the form an older checkout takes; `NAME=` runs from here): a
    # training a variant keeps the suite short
    out = subprocess.run(["bash", "scripts/device/train_ab.sh", "3", "b=@."], env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("b:")]
    assert len(lines) == 1, out.stdout + out.stderr + (tmp_path / "logs" / "ab-b.log").read_text()[-2000:]
    assert " 3 steps, " in lines[0] and "steps/s over the loop" in lines[0], lines[0]
    assert (tmp_path / "ab-b" / "predicted.json").exists()


def test_bench_gemm_triton_tiles_compute_the_linear():
    """scripts/bench_gemm.py's Triton kernel (timed against cuBLAS on a GPU) computes F.linear at
    row counts below, at and above tl.dot's 16 and shapes that are no multiple of its tiles; the
    interpreter on a CPU."""
    import torch.nn.functional as F

    from scripts.bench_gemm import skinny
    from tests.conftest import kernel_device

    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 40, 70), (7, 96, 64), (17, 33, 130)):
        x, w = torch.randn(M, K, generator=g).to(dev), torch.randn(N, K, generator=g).to(dev)
        out = torch.empty(M, N, device=dev)
        skinny(x, w, out, 16, 64, 4, 2)
        tol = 1e-4 if dev == "cpu" else 2e-2  # (a GPU's float32 tl.dot multiplies in TF32)
        torch.testing.assert_close(out, F.linear(x, w), rtol=tol, atol=tol)


def test_kernel_registers_compiles_the_tree_kernels_for_an_h200_without_spills():
    """scripts/kernel_registers.py compiles for sm_90 with Triton's own ptxas (no GPU needed):
    the tree step's bookkeeping and rerank kernels at the runtime's settings fit their registers."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run([sys.executable, "scripts/kernel_registers.py", "--kernel", "tree_accept", "--kernel",
                          "rerank", "--standing", "--json"], cwd=root, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in rows] == ["tree_accept", "rerank"]
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["stack"] == 0, r
