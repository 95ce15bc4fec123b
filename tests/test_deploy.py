"""`python -m inference.deploy`: the best choice per batch size, the draft-length table in a copy
of the export and the server flags that read it, the target rounded as quantised servers store
it, and the report on a tiny export."""
import hashlib
import json
import math
import shlex
from pathlib import Path

import pytest
import torch

from inference.deploy import best_choice, bucket_bounds, bucket_of, table_rows
from inference.quantize import fp8_e4m3_round, int4_group_round, restore_, round_target_
from tests.conftest import make_conversations, run_module
from tests.test_launch_lines import run_vllm, vllm_path, write_drafter  # noqa: F401  (vllm_path: the fixture)


# ---------------------------------------------------------------- the choice (synthetic timings)
def test_best_choice_per_batch_includes_off_and_ties_go_to_less_drafting():
    timings = {1: {"off": 100.0, "k=2": 180.0, "k=4": 230.0, "tree 4,8,32": 250.0},
               16: {"off": 1000.0, "k=2": 1300.0, "k=4": 1300.0, "tree 4,8,32": 900.0},
               64: {"off": 3000.0, "k=2": 2900.0, "k=4": 2200.0, "tree 4,8,32": None},
               128: {"off": None, "k=2": 5000.0}}  # plain not measured (out of memory): no choice
    best = best_choice(timings)
    assert best[1]["choice"] == "tree 4,8,32" and best[1]["k"] is None and best[1]["vs_plain"] == pytest.approx(2.5)
    assert best[16]["choice"] == "k=2" and best[16]["k"] == 2  # a tie: the shorter chain
    assert best[64] == {"choice": "off", "k": 0, "tokens_per_s": 3000.0, "vs_plain": 1.0}
    assert 128 not in best
    chains = best_choice(timings, chains_only=True)  # what a table can hold
    assert {b: c["k"] for b, c in chains.items()} == {1: 4, 16: 2, 64: 0}
    assert best_choice({8: {"off": 5.0, "k=3": 5.0}})[8]["choice"] == "off"  # a tie with plain: off


def test_table_rows_cover_every_batch_from_one_and_merge_equal_neighbours():
    assert table_rows({1: 4, 2: 4, 4: 2, 8: 2, 16: 1, 64: 0}) == [[1, 3, 4], [4, 15, 2], [16, 63, 1], [64, 64, 0]]
    assert table_rows({4: 3, 16: 0}) == [[1, 15, 3], [16, 16, 0]]  # the first row starts at batch 1
    buckets = bucket_bounds([512, 2048])
    assert buckets == [(0, 512), (512, 2048)]
    assert [bucket_of(n, buckets) for n in (0, 511, 512, 2047, 2048)] == [0, 0, 1, 1, None]
    assert bucket_of(5000, buckets, clamp=True) == 1


# ---------------------------------------------------------------- rounding against references
def _e4m3_reference(x: float) -> float:
    """Round-to-nearest-even onto float8 e4m3fn's grid, by arithmetic: 3 mantissa bits, exponents
    from -6 (below: subnormals in steps of 2^-9), largest finite 448."""
    if x == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(x))), -6)
    step = 2.0 ** (e - 3)
    q = round(x / step) * step  # Python's round: half to even
    return max(-448.0, min(448.0, q))


def test_fp8_round_trip_matches_the_reference_grid_and_its_bound():
    torch.manual_seed(0)
    w = torch.randn(6, 200, dtype=torch.float64).float() * torch.logspace(-4, 1, 200)  # [out, in], many magnitudes
    q = fp8_e4m3_round(w)
    scale = w.abs().amax(1, keepdim=True) / 448
    ref = torch.tensor([[_e4m3_reference(v) for v in row] for row in (w / scale).tolist()]) * scale
    assert torch.allclose(q, ref, rtol=1e-6, atol=0)
    scaled = (w / scale).abs()
    err = (q - w).abs()
    normal = scaled >= 2 ** -6
    # 3 mantissa bits: half a step is 2^-4 of the value (normal); 2^-10 of the scale below 2^-6
    # (subnormal); plus float32's rounding of the scale and the product
    assert normal.any() and (~normal).any()
    assert (err[normal] <= (2 ** -4 + 1e-6) * w.abs()[normal]).all()
    assert (err[~normal] <= (2 ** -10 + 1e-6) * scale.expand_as(w)[~normal]).all()
    assert torch.allclose(q.abs().amax(1), w.abs().amax(1), rtol=1e-6)  # each row's largest value: 448 x its scale
    assert fp8_e4m3_round(w.bfloat16()).dtype == torch.bfloat16


def test_int4_groups_of_128_are_within_half_a_step_and_match_a_loop_reference():
    torch.manual_seed(1)
    w = torch.randn(3, 320) * 0.02  # [out, in]: groups of 128, 128 and a last one of 64
    q = int4_group_round(w)
    for r in range(3):
        for start in range(0, 320, 128):
            g = w[r, start : start + 128]
            lo, hi = g.min(), g.max()
            scale = (hi - lo) / 15
            zero = torch.round(-lo / scale)
            ref = (torch.clamp(torch.round(g / scale) + zero, 0, 15) - zero) * scale
            assert torch.allclose(q[r, start : start + 128], ref, atol=1e-7)
            assert ((q[r, start : start + 128] - g).abs() <= scale / 2 + 1e-7).all()
            assert len(set(q[r, start : start + 128].tolist())) <= 16  # 4 bits: at most 16 values per group


def test_round_target_rounds_the_layer_matrices_only_and_restores_them(tiny_target):
    from inference.runtime.fallback import load_runtime

    rt = load_runtime(tiny_target)
    before = {n: p.clone() for n, p in rt.named_parameters()}
    saved = round_target_(rt, "int4-g128")
    changed = {n for n, p in rt.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".layers." in f".{n}" for n in changed) and not any("embed" in n or "norm" in n for n in changed)
    restore_(rt, saved)
    assert all(torch.equal(p, before[n]) for n, p in rt.named_parameters())
    with pytest.raises(ValueError, match="not one of"):
        round_target_(rt, "nf4")


# ---------------------------------------------------------------- the command on a tiny export
@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_target):
    """A tiny target with larger random weights (answers of many different tokens), a random
    EAGLE-3 export for it, and a chat file of multi-turn conversations."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from export.speculators import export_speculators
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    root = tmp_path_factory.mktemp("deploy")
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(root / "target")
    AutoTokenizer.from_pretrained(tiny_target).save_pretrained(root / "target")
    hf = AutoConfig.from_pretrained(root / "target")
    drafter = Eagle3Drafter(Eagle3Config.from_target(hf, hf.vocab_size))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.05)
    export_speculators(drafter.eval(), root / "export", target_name=str(root / "target"), target_arch=["LlamaForCausalLM"],
                       k=3, dtype=torch.float32)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_conversations(30)))
    return root


def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_deploy_writes_every_section_and_the_table_into_a_copy(world):
    from export.io import read_k_table
    from export.paths import read_marker

    export, before = world / "export", _digest(world / "export")
    out = world / "report"
    res = run_module("inference.deploy", "--drafter", str(export), "--target", str(world / "target"), "--num-prompts", "2",
                     "--max-new-tokens", "8", "-k", "2", "--batch-sizes", "1", "2", "4", "--context-dataset",
                     str(world / "chat.jsonl"), "--context-buckets", "64", "128", "--device", "cpu", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {"speed", "best", "table", "table_vs_fixed", "context", "precision"} <= set(report)
    assert set(report["speed"]) == {"1", "2", "4"}
    for batch in ("1", "2", "4"):
        options = report["speed"][batch]["options"]
        assert set(options) == {"off", "k=2"} and all(o["tokens_per_s"] > 0 for o in options.values())
        assert report["best"][batch]["choice"] in options
    rows = report["table"]["rows"]
    assert rows[0][0] == 1 and rows[-1][1] == 4 and {k for _, _, k in rows} <= {0, 2}
    assert set(report["table_vs_fixed"]) == {"1", "2", "4"}
    buckets = report["context"]["buckets"]
    assert [b["bucket"] for b in buckets] == [[0, 64], [64, 128]]
    assert all(b["answers"] > 0 and b["measured"]["num_chains"] > 0 and b["predicted"]["num_chains"] > 0 for b in buckets)
    schemes = report["precision"]["schemes"]
    assert set(schemes) == {"as loaded", "fp8-e4m3", "int4-g128"} and schemes["as loaded"]["tau_vs_loaded"] == 1
    assert all(len(s["a"]) == 2 and s["num_chains"] > 0 for s in schemes.values())
    for name in ("report.md", "speedup_vs_batch.png", "acceptance_vs_context.png", "acceptance_vs_precision.png"):
        assert (out / name).stat().st_size > 0, name
    # the table went into a copy; the user's export is as it was
    copy = out / "export-with-table"
    assert read_k_table(copy)[:-1] == rows[:-1] and read_k_table(copy)[-1][:1] == rows[-1][:1]
    assert json.loads((copy / "draftsmith.json").read_text())["k_table"]["rows"] == rows
    assert _digest(export) == before
    assert read_marker(copy)["tool"] == "export" and read_marker(out)["tool"] == "deploy"
    assert (copy / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()
    # run again into its own folder: replaced; the export itself is never a destination
    again = run_module("inference.deploy", "--drafter", str(export), "--write-table-to", str(export), "--out", str(out))
    assert again.returncode == 2 and again.stderr.startswith("error: --write-table-to") and "copy" in again.stderr
    inside = run_module("inference.deploy", "--drafter", str(export), "--write-table-to", str(out / "t"), "--out", str(out))
    assert inside.returncode == 2 and "must be apart" in inside.stderr and not (out / "t").exists()


@pytest.mark.parametrize("args, message", [
    (["--context-buckets", "512", "128"], "--context-buckets: edges must be increasing"),
    (["--batch-sizes", "0", "4"], "--batch-sizes: must be positive"),
    (["--synthetic-acceptance", "1.5"], "--synthetic-acceptance: must be in [0, 1]"),
])
def test_bad_input_is_one_line(world, tmp_path, args, message):
    res = run_module("inference.deploy", "--drafter", str(world / "export"), "--out", str(tmp_path / "o"), *args)
    assert res.returncode == 2 and res.stderr.startswith(f"error: {message}"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


TABLE = {"rows": [[1, 1, 5], [2, 7, 3], [8, 64, 0]]}


def test_the_table_reaches_vllm_as_its_scheduler_reads_it_and_the_runtime_reads_the_same(world, tmp_path, vllm_path):
    """The printed vLLM line through vLLM 0.33's own field type and dense batch-size lookup
    (tests/vllm_args.py), against the runtime's draft_length on the table read back from the copy."""
    from export.io import read_k_table
    from inference.deploy_report import write_table_copy
    from inference.runtime.engine import draft_length

    copy, lines, notes = write_table_copy(world / "export", tmp_path / "copy", TABLE, None)
    (line,) = lines
    words = shlex.split(line)
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 5 and spec["num_speculative_tokens_per_batch_size"] == TABLE["rows"]
    assert spec["model"] == str(tmp_path / "copy") and any("vLLM 0.33" in n for n in notes)
    runtime = [draft_length(read_k_table(copy), b, 5) for b in range(1, 65)]
    assert runtime == [5] + [3] * 6 + [0] * 57
    (result,) = run_vllm(lines, tmp_path, vllm_path)
    assert "error" not in result, result
    assert result["k_by_batch"] == runtime


def test_sglang_gets_the_table_as_adaptive_slots_of_one_candidate(tmp_path):
    """SGLang 0.5.23's EAGLE3 chain line: --speculative-adaptive with a slot per row, each with
    the row's k as its only candidate, and the table's largest k as the steps it sizes for. (The
    line runs through SGLang's argument code, tests/sglang_args.py, with speculative_adaptive
    still on after its checks: verified when this was written; not kept, a subprocess importing
    SGLang costs about 15 s of CI time.)"""
    from inference.deploy_report import write_table_copy
    from tests.test_launch_lines import place_target

    place_target(tmp_path / "target")
    write_drafter("EAGLE3", tmp_path / "export", target=str(tmp_path / "target"), k=4)
    copy, lines, notes = write_table_copy(tmp_path / "export", tmp_path / "copy", TABLE, None)
    (line,) = lines
    words = shlex.split(line)
    flag = lambda name: words[words.index(name) + 1]  # noqa: E731
    assert (flag("--speculative-algorithm"), flag("--speculative-eagle-topk")) == ("EAGLE3", "1")
    assert (flag("--speculative-num-steps"), flag("--speculative-num-draft-tokens")) == ("5", "6")
    assert "--speculative-adaptive" in words and flag("--speculative-adaptive-config") == str(copy / "sglang_adaptive.json")
    assert json.loads((copy / "sglang_adaptive.json").read_text()) == {
        "1": {"candidate_steps": [5]}, "2": {"candidate_steps": [3]}, "8": {"candidate_steps": [0]}}
    assert any("SGLang 0.5.23" in n for n in notes)


def test_generate_takes_its_k_from_the_exports_table(world, tmp_path):
    from inference.deploy_report import write_table_copy

    copy, _, _ = write_table_copy(world / "export", tmp_path / "copy", {"rows": [[1, 1, 2], [2, 8, 0]]}, None)
    res = run_module("inference.generate", "--target", str(world / "target"), "--drafter", str(copy), "--prompt", "Hi.",
                     "--max-new-tokens", "6", "--device", "cpu", "--stats")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stderr.strip().splitlines()[-1])["k"] == 2


def test_export_check_names_a_malformed_table(world, tmp_path):
    """export.check reads the table as the runtime and the launch lines do: a copy with a valid
    table passes level (a); rows that do not start at batch 1, or no rows at all, are a problem
    naming the table."""
    from export.check import run_checks
    from inference.deploy_report import write_table_copy

    copy, _, _ = write_table_copy(world / "export", tmp_path / "copy", TABLE, None)
    assert next(c for c in run_checks(copy, target=str(world / "target")) if c.level == "a").ok
    meta_path = copy / "draftsmith.json"
    meta = json.loads(meta_path.read_text())
    for bad in ({"rows": [[2, 4, 3]]}, [[1, 4, 3]]):
        meta["k_table"] = bad
        meta_path.write_text(json.dumps(meta))
        keys = next(c for c in run_checks(copy, target=str(world / "target")) if c.level == "a")
        assert not keys.ok and any("k_table" in p for p in keys.problems), keys.problems
