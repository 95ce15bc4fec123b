"""The feature store (train/extract.py, data/features.py): extract once, train from disk.

One module fixture extracts the tiny recipe's training data into a float32 store with the exact
teacher (top-k = the whole draft vocabulary); the tests train from it and compare with online
training, kill and resume an extraction, refuse stores of other settings, and bound FP8."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import make_conversations, tiny_overrides, train_at_once

SHORT = {"trainer.max_steps": 3, "checkpoint_every_n_steps": 3, "eval.every_n_steps": 3, "eval.temperatures": [0.0],
         "data.limit": 40}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """(overrides(out_dir, **extra), the run config, a float32 store of its training split in 2+ shards)."""
    from train.extract import extract
    from train.config import load_config

    root = tmp_path_factory.mktemp("extract")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))

    def overrides(out_dir, **extra):
        return tiny_overrides(str(chat), out_dir, **{**SHORT, **extra})

    cfg = load_config(None, overrides(root / "run"))
    store = root / "store32"
    manifest = extract(cfg, str(store), dtype="float32", topk=0, shard_tokens=1200, progress=False)
    assert manifest["complete"] and manifest["num_shards"] >= 3 and manifest["teacher"]["exact"]
    return overrides, cfg, store


def _columns(store):
    """Every shard's table, in order (the comparison of two stores)."""
    return [pq.read_table(f) for f in sorted(store.glob("shard-*.parquet"))]


def test_training_from_a_float32_store_equals_online_training(recipe, tmp_path):
    from tests.test_fsdp import _assert_same_run

    overrides, _, store = recipe
    online, stored = tmp_path / "online", tmp_path / "stored"
    # beside them, a launch whose drafter reads other layers (mostly imports: it stops before any model loads)
    refused = subprocess.Popen([sys.executable, "-m", "train", *overrides(tmp_path / "refused"), f"data.features={store}",
                                "drafter.aux_layer_ids=[1]"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # (the stored run reads through a DataLoader worker process, as the recipes do)
    train_at_once(overrides(online), [*overrides(stored), f"data.features={store}", "data.num_workers=1"])
    err = refused.communicate(timeout=300)[1]
    assert refused.returncode == 2, err[-2000:]
    last = err.strip().splitlines()[-1]  # one error line, exit 2, nothing written
    assert last.startswith("error: data.features:") and "layers [0, 1], not this run's drafter.aux_layer_ids [1]" in last
    assert "Traceback" not in err and not (tmp_path / "refused").exists()
    _assert_same_run(online, stored)  # float32 noise (atol 1e-6), same optimizer state, same export
    a = json.loads((online / "predicted.json").read_text())["predicted"]
    b = json.loads((stored / "predicted.json").read_text())["predicted"]
    assert a["tau"] == pytest.approx(b["tau"], abs=1e-6)


def test_a_killed_extraction_resumes_to_the_same_store_and_training_refuses_it_until_then(recipe, tmp_path):
    from train.extract import extract
    from data.features import StoreError, check_store, read_manifest

    _, cfg, store = recipe
    again = tmp_path / "again"
    with pytest.raises(RuntimeError, match="stopped after 1 shard"):
        extract(cfg, str(again), dtype="float32", topk=0, shard_tokens=1200, progress=False, stop_after_shards=1)
    half = read_manifest(again)
    assert not half["complete"] and [s["file"] for s in half["shards"]] == ["shard-00000.parquet"]
    assert not list(again.glob(".shard-*"))  # nothing half-written left beside the shards
    with pytest.raises(StoreError, match=r"unfinished extraction \(1 of \d+ shards\)"):
        check_store(str(again), None)
    (again / ".shard-00001.parquet.x1").write_bytes(b"half a shard")  # what a SIGKILL mid-write leaves
    # resumed through --device-map (a target spread over devices by accelerate, its layers' outputs
    # gathered on --device): on the CPU `auto` maps every layer to it, through the path a
    # multi-GPU map takes; the shards it writes equal the plain extraction's
    full = extract(cfg, str(again), dtype="float32", topk=0, shard_tokens=1200, progress=False, device="cpu",
                   device_map="auto")
    assert full["complete"] and not list(again.glob(".shard-*")) and full["extraction"]["device"] == "device_map=auto"
    ta, tb = _columns(store), _columns(again)
    assert len(ta) == len(tb) == full["num_shards"] and all(a.equals(b) for a, b in zip(ta, tb))
    # the same command with other settings is refused in one line, the store untouched
    with pytest.raises(Exception, match=r"holds a store of other settings \(dtype, teacher differ\)"):
        extract(cfg, str(again), dtype="bf16", topk=0, shard_tokens=1200, progress=False)


def test_a_store_of_another_target_layers_or_data_is_refused_in_one_line(recipe):
    """(The command line's refusal is checked beside the training test's runs.)"""
    from data.chat import build_datasets
    from data.features import Expected, StoreError, check_store, data_fingerprint, read_manifest

    _, cfg, store = recipe
    m = read_manifest(store)
    fits = Expected(target=cfg.target, weights_sha256=m["target"]["weights_sha256"], layers=m["layers"], fields=["aux"],
                    data_fingerprint=m["data"]["fingerprint"], dataset=cfg.data.dataset,
                    vocab_fingerprint=m["draft_vocab"]["fingerprint"], draft_vocab_size=m["draft_vocab"]["size"])
    assert check_store(str(store), fits) == m
    from transformers import AutoTokenizer

    from models.zoo import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target(cfg.target))
    fewer, _ = build_datasets(cfg.data.dataset, tok, cfg.data.max_length, 30, cfg.data.heldout_fraction)
    cases = {"another target": replace(fits, target="other", weights_sha256="0" * 64),
             "target layers": replace(fits, layers=[1, 0]),
             "other data": replace(fits, data_fingerprint=data_fingerprint(fewer)),
             "another draft vocabulary": replace(fits, vocab_fingerprint="1" * 64),
             "reads last_hidden": replace(fits, fields=["last_hidden"])}
    for words, expected in cases.items():
        with pytest.raises(StoreError, match=words) as e:
            check_store(str(store), expected)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"data.features: {store}")


def test_a_store_with_a_shard_missing_or_cut_or_a_manifest_without_a_key_is_refused_in_one_line(recipe, tmp_path):
    """Damage found before any run folder is made, not a FileNotFoundError / KeyError mid-training."""
    import shutil

    from data.features import Expected, StoreError, check_store, read_manifest

    _, cfg, store = recipe
    m = read_manifest(store)
    fits = Expected(target=cfg.target, weights_sha256=m["target"]["weights_sha256"], layers=m["layers"], fields=["aux"],
                    data_fingerprint=m["data"]["fingerprint"], dataset=cfg.data.dataset,
                    vocab_fingerprint=m["draft_vocab"]["fingerprint"], draft_vocab_size=m["draft_vocab"]["size"])

    def damaged(name, edit):
        copy = tmp_path / name
        shutil.copytree(store, copy)
        edit(copy)
        with pytest.raises(StoreError) as e:
            check_store(str(copy), fits)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"data.features: {copy}")
        return str(e.value)

    def without_target(copy):
        manifest = json.loads((copy / "manifest.json").read_text())
        del manifest["target"]
        (copy / "manifest.json").write_text(json.dumps(manifest))

    assert "shard-00001.parquet is missing" in damaged("missing", lambda c: (c / "shard-00001.parquet").unlink())
    size = m["shards"][1]["bytes"]
    assert f"shard-00001.parquet is 100 bytes, not the {size} written" in damaged(
        "cut", lambda c: os.truncate(c / "shard-00001.parquet", 100))
    assert "manifest.json is malformed (no 'target'" in damaged("no-target", without_target)


def test_fp8_and_bf16_stores_stay_within_their_rounding_and_load_with_datasets(recipe, tmp_path):
    import datasets

    from train.extract import extract
    from data.features import decode, fp8_error_bound

    _, cfg, store = recipe
    stores = {}
    for dtype in ("bf16", "fp8-e4m3"):
        stores[dtype] = tmp_path / dtype
        m = extract(cfg, str(stores[dtype]), dtype=dtype, topk=8, shard_tokens=100_000, progress=False)
        assert m["teacher"] == {"topk": 8, "over": "draft vocabulary", "logprobs_dtype": "float16", "exact": False}
    exact = pq.read_table(sorted(store.glob("shard-*"))[0]).slice(0, 5).to_pydict()
    bf16 = pq.read_table(sorted(stores["bf16"].glob("shard-*"))[0]).slice(0, 5).to_pydict()
    fp8 = pq.read_table(sorted(stores["fp8-e4m3"].glob("shard-*"))[0]).slice(0, 5).to_pydict()
    for r in range(5):
        x = torch.tensor(exact["aux"][r])  # [T, 2*64] float32: the target's features
        b = decode(np.array(bf16["aux"][r], dtype=np.uint16), None, "bf16").float()
        scale = torch.tensor(fp8["aux_scale"][r])
        q = decode(np.array(fp8["aux"][r], dtype=np.uint8), scale.numpy(), "fp8-e4m3")
        assert scale.shape == (x.shape[0], 2)  # a scale per token and layer
        torch.testing.assert_close(b, x, rtol=2**-8, atol=0)  # bf16: half an ulp of 8 bits
        bound = fp8_error_bound(x, scale)
        assert ((q - x).abs() <= bound * (1 + 1e-6)).all()
        # against the bf16 store's features: FP8's bound plus bf16's own rounding
        assert ((q - b).abs() <= bound + x.abs() * 2**-8 + 1e-12).all()
        assert (q - x).abs().max() > 0  # (FP8 did round: the test can fail)
        # the top-8 teacher holds the exact teacher's 8 largest log-probabilities
        top = torch.tensor(exact["teacher_logprobs"][r]).topk(8, -1).values
        torch.testing.assert_close(torch.tensor(bf16["teacher_logprobs"][r]), top, rtol=1e-3, atol=1e-3)
        assert bf16["greedy"][r] == exact["greedy"][r] == fp8["greedy"][r]
    # fp8 (with its scales) takes less room than bf16, which takes half of float32's features
    bpt = {name: json.loads((s / "manifest.json").read_text())["bytes_per_token"]["features"]
           for name, s in {"float32": store, **stores}.items()}
    assert bpt["fp8-e4m3"] < bpt["bf16"] < 0.6 * bpt["float32"]
    loaded = datasets.load_dataset("parquet", data_files=sorted(str(f) for f in stores["fp8-e4m3"].glob("shard-*.parquet")),
                                   split="train", cache_dir=str(tmp_path / "hf"))
    assert len(loaded) == json.loads((stores["fp8-e4m3"] / "manifest.json").read_text())["data"]["conversations"]
    assert {"index", "input_ids", "loss_mask", "greedy", "aux", "aux_scale", "teacher_ids", "teacher_logprobs"} <= set(loaded.column_names)
    assert loaded[0]["input_ids"] == fp8["input_ids"][0] and len(loaded[0]["aux"][0]) == 128


def test_fp8_round_trip_bound_on_a_wide_range():
    from data.features import fp8_dequantise, fp8_error_bound, fp8_quantise

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * 32, generator=g) * torch.logspace(-4, 3, 64)[:, None]  # rows of very different size
    x[0, :32] = 0  # a layer that is all zeros keeps zeros
    bits, scale = fp8_quantise(x, groups=3)
    assert bits.dtype == torch.uint8 and scale.shape == (64, 3)
    y = fp8_dequantise(bits, scale)
    assert ((y - x).abs() <= fp8_error_bound(x, scale) * (1 + 1e-6)).all()
    assert torch.equal(y[0, :32], torch.zeros(32))
    rel = ((y - x).abs() / x.abs().clamp_min(1e-30))[x.abs() > scale.repeat_interleave(32, -1) * 2**-6]
    assert 0.01 < rel.max() <= 2**-4  # e4m3: 3 mantissa bits



@pytest.mark.parametrize("name", ["eagle3", "medusa"])
def test_a_stored_batch_gives_the_training_step_what_the_target_pass_gives(name, tmp_path):
    """Per field kind (EAGLE-3 reads the aux layers, Medusa the final hidden state): rows written
    as train.extract writes them and read back through the store's collate give `_stored_pass`
    the features, teacher and greedy tokens `_target_pass` computes online, at every real position."""
    from tqdm import tqdm

    from train.extract import _shard_rows
    from data.features import StoreDataset, needed_fields, write_shard
    from models.draft_vocab import draft_ids
    from tests.test_fsdp import _drafter_and_target
    from train.config import EvalConfig, ObjectiveConfig, OptimConfig
    from train.module import DrafterModule

    drafter, target = _drafter_and_target(name)
    fields = needed_fields(drafter, feature_regression=False)
    assert fields == (["aux"] if name == "eagle3" else ["last_hidden"])
    g = torch.Generator().manual_seed(1)
    lengths = [9, 23, 17, 30, 5]
    convs = [{"input_ids": torch.randint(3, 900, (n,), generator=g).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2)}
             for n in lengths]
    vd = drafter.d2t.numel()
    rows = _shard_rows(target, convs, range(len(convs)), lengths, 0, draft_ids(drafter.d2t), vd, fields, "float32", 2,
                       torch.device("cpu"), tqdm(disable=True))
    write_shard(tmp_path / "shard-00000.parquet", rows, fields, "float32", "zstd")
    manifest = {"fields": fields, "dtype": "float32", "shards": [{"file": "shard-00000.parquet", "rows": len(convs)}]}
    store = StoreDataset(str(tmp_path), manifest, lengths, pad_id=0)
    batch = store.collate([store[i] for i in (3, 0, 4)])
    module = DrafterModule(target, drafter, ObjectiveConfig(), OptimConfig(), EvalConfig(), 10,
                           stored_features_dtype=torch.float32)
    assert "target" not in dict(module.named_children())  # Lightning never moves it to the device
    stored, teacher, greedy = module._stored_pass(batch)
    online, teacher_online, greedy_online = module._target_pass(batch["input_ids"])
    field = fields[0]
    for b, n in enumerate(batch["lengths"].tolist()):
        torch.testing.assert_close(getattr(stored, field)[b, :n], getattr(online, field)[b, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(teacher[b, :n], teacher_online[b, :n], rtol=1e-5, atol=1e-6)
        assert torch.equal(greedy[b, :n], greedy_online[b, :n])
