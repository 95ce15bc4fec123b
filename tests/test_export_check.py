"""export.check: every method's export passes; each kind of corruption fails, named."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from export.check import run_checks
from tests.conftest import make_conversations, run_module, tiny_overrides
from train.config import load_config
from train.run import run

RECIPES = {"eagle3": (None, {}), "eagle1": ("configs/eagle1.yaml", {}), "medusa": ("configs/medusa1.yaml", {}),
           "mtp": ("configs/mtp.yaml", {}),
           "dflash": ("configs/dflash.yaml", {"drafter.dflash.layers": 2, "drafter.dflash.block_size": 4, "eval.k": 3})}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(120)))
    out = {}
    for method, (recipe, extra) in RECIPES.items():
        overrides = tiny_overrides(str(chat), root / method, **{"trainer.max_steps": 2, "trainer.precision": "32-true", **extra})
        if method in ("eagle1", "mtp"):
            overrides.append("drafter.draft_vocab_size=49152")
        run(load_config(recipe, overrides))
        out[method] = root / method / "export"
    return out


@pytest.mark.parametrize("method", list(RECIPES))
def test_every_methods_export_passes_all_four_levels(exports, method):
    checks = run_checks(exports[method])
    assert [c.level for c in checks] == ["a", "b", "c", "d"]
    assert all(c.ok for c in checks), [c.line() for c in checks]
    parity = next(c for c in checks if c.level == "c")
    assert "max abs diff" in parity.notes[0]


def _copy(exports, tmp_path, method="eagle3"):
    folder = tmp_path / method
    shutil.copytree(exports[method], folder)
    return folder


def _failing(folder):
    """export.check's verdict on a folder that must fail (main in this process: tests.conftest.run_module)."""
    res = run_module("export.check", str(folder))
    assert res.returncode == 1, res.stdout + res.stderr
    return res.stdout


def test_a_removed_tensor_is_named(exports, tmp_path):
    folder = _copy(exports, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["fc.weight"]
    save_file(state, str(folder / "model.safetensors"))
    out = _failing(folder)
    assert "(a)" in out and "fc.weight" in out and "FAIL" in out


def test_a_changed_shape_is_named(exports, tmp_path):
    folder = _copy(exports, tmp_path, "medusa")
    state = load_file(str(folder / "model.safetensors"))
    state["lm_heads.1.weight"] = state["lm_heads.1.weight"][:-1].clone()
    save_file(state, str(folder / "model.safetensors"))
    out = _failing(folder)
    assert "lm_heads.1.weight" in out and "shape" in out


def test_a_changed_flag_is_named(exports, tmp_path):
    folder = _copy(exports, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["norm_before_fc"] = not config["norm_before_fc"]
    (folder / "config.json").write_text(json.dumps(config))
    out = _failing(folder)
    assert "(b)" in out and "norm_before_fc" in out


def test_a_truncated_file_is_named(exports, tmp_path):
    folder = _copy(exports, tmp_path, "mtp")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = _failing(folder)
    assert "model.safetensors is unreadable" in out


def test_a_random_embedding_is_caught(exports, tmp_path):
    import torch

    folder = _copy(exports, tmp_path, "eagle1")
    state = load_file(str(folder / "model.safetensors"))
    state["embed_tokens.weight"] = torch.randn_like(state["embed_tokens.weight"])
    save_file(state, str(folder / "model.safetensors"))
    out = _failing(folder)
    assert "(d)" in out and "embed_tokens differs" in out


def test_an_interrupted_export_leaves_the_old_one_intact(exports, tmp_path):
    from export.medusa import export_medusa, load_medusa

    folder = _copy(exports, tmp_path, "medusa")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    drafter = load_medusa(folder)

    class Boom(RuntimeError):
        pass

    import export.io as io_module  # every exporter writes its files through export.io

    original = io_module.save_file

    def dies_midway(tensors, path, metadata=None):
        original(tensors, path, metadata=metadata)
        raise Boom("interrupted after writing the weights")

    io_module.save_file = dies_midway
    try:
        with pytest.raises(Boom):
            export_medusa(drafter, folder, target_name="tiny-random-llama", runtime_only=True)
    finally:
        io_module.save_file = original
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".medusa")]  # no temporary left behind


# pairs the tiny recipes cannot be served as: EAGLE-1 with an fc bias in vLLM; Medusa with Vd < V
SERVER_REFUSES = {("eagle1", "eagle-vllm"): "vLLM 0.33's EAGLE-1 fc has no bias", ("medusa", "medusa"): "vLLM 0.33 has no Medusa"}


def test_export_cli_writes_every_supported_pair_and_refuses_the_rest(exports, tmp_path, capsys):
    """python -m export from a run folder: each (method, format) pair the format supports
    passes export.check and drafts what the training checkpoint drafts; others fail clearly."""
    import torch

    from export.__main__ import FORMATS
    from export.load import load_export

    all_formats = sorted({f for fs in FORMATS.values() for f in fs})
    for method, export_dir in exports.items():
        run_dir = export_dir.parent
        for fmt in all_formats:
            out = tmp_path / f"{method}-{fmt}"
            from export.__main__ import main as export_main

            code = export_main(["--checkpoint", str(run_dir), "--format", fmt, "--out", str(out), "--dtype", "float32"])
            err = capsys.readouterr().err
            if fmt not in FORMATS[method]:
                assert code == 2 and f"cannot carry a {method} drafter" in err and len(err.strip().splitlines()) == 1, err
                assert not out.exists()
                continue
            if (method, fmt) in SERVER_REFUSES:  # the recipe trains what that server cannot compute
                assert code == 2 and SERVER_REFUSES[method, fmt] in err and len(err.strip().splitlines()) == 1, err
                assert not out.exists()
                continue
            assert code == 0, err[-2000:]
            checks = run_checks(out)
            assert all(c.ok for c in checks), (method, fmt, [c.line() for c in checks])
            # (c) compared this export with the training checkpoint: same outputs within 1e-5 in
            # float32, hence the same drafts; the runtime reads it through the same reader
            parity = next(c for c in checks if c.level == "c")
            assert float(parity.notes[0].split()[3]) <= 1e-5
            from inference.proposers import drafter_proposer
            from types import SimpleNamespace

            drafter = load_export(out)
            target_config = SimpleNamespace(vocab_size=drafter.config.vocab_size, hidden_size=drafter.config.hidden_size,
                                            num_layers=2)
            drafter_proposer(drafter, 2, 1, 64, target_config)  # the runtime accepts it


def test_sglang_refuses_a_normed_drafter_naming_the_option(exports, tmp_path):
    from export.sglang import UnsupportedOption, export_sglang
    from export.speculators import load_speculators

    drafter = load_speculators(exports["eagle3"])
    drafter.config.norm_before_residual = True
    with pytest.raises(UnsupportedOption, match="norm_before_residual.*speculators"):
        export_sglang(drafter, tmp_path / "x", target_name="tiny-random-llama")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("method", list(RECIPES))
def test_an_export_made_elsewhere_reads_the_same_without_draftsmith_json(exports, method, tmp_path):
    """Readers take a layout's own config.json when no draftsmith.json is there (a folder made
    by another trainer), so such exports can be served and validated too."""
    import torch

    from export.load import load_export

    folder = _copy(exports, tmp_path, method)
    (folder / "draftsmith.json").unlink()
    ours, foreign = load_export(exports[method]), load_export(folder)
    a, b = ours.state_dict(), foreign.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _exported(exports, tmp_path, method, fmt):
    from export.__main__ import main as export_main

    out = tmp_path / f"{method}-{fmt}"
    assert export_main(["--checkpoint", str(exports[method].parent), "--format", fmt, "--out", str(out), "--dtype", "float32"]) == 0
    return out


def _edit(config: dict, path: str, change):
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = change(node[last])


# every field a server reads from config.json, edited: export.check names it (level b)
SERVED_FIELDS = [
    ("eagle3", "speculators", "draft_vocab_size", lambda v: v // 2, "draft_vocab_size"),
    ("eagle3", "speculators", "transformer_layer_config.intermediate_size", lambda v: v * 2, "intermediate_size"),
    ("eagle3", "speculators", "transformer_layer_config.rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
    ("eagle3", "speculators", "transformer_layer_config.rope_theta", lambda v: v * 2, "rope_theta"),
    ("eagle3", "speculators", "eagle_aux_hidden_state_layer_ids", lambda v: v[:-1], "aux_layer_ids"),
    ("eagle3", "speculators", "norm_before_fc", lambda v: not v, "norm_before_fc"),
    ("eagle3", "speculators", "norm_before_residual", lambda v: not v, "norm_before_residual"),
    ("eagle3", "speculators", "speculators_config.proposal_methods.0.speculative_tokens", lambda v: v + 1, "speculative_tokens"),
    ("eagle3", "sglang", "draft_vocab_size", lambda v: v // 2, "draft_vocab_size"),
    ("eagle3", "sglang", "intermediate_size", lambda v: v * 2, "intermediate_size"),
    ("eagle3", "sglang", "rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
    ("eagle3", "sglang", "eagle_config.norm_before_fc", lambda v: not v, "norm_before_fc"),
    ("eagle3", "sglang", "eagle_config.eagle_aux_hidden_state_layer_ids", lambda v: v[:-1], "aux_layer_ids"),
    ("dflash", "speculators", "transformer_layer_config.is_causal", lambda v: True, "is_causal"),
    ("dflash", "speculators", "transformer_layer_config.rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
    ("dflash", "speculators", "aux_hidden_state_layer_ids", lambda v: v[:-1], "target_layer_ids"),
    ("dflash", "speculators", "speculators_config.proposal_methods.0.speculative_tokens", lambda v: v + 1, "speculative_tokens"),
    ("dflash", "dflash", "rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
    ("dflash", "dflash", "intermediate_size", lambda v: v * 2, "intermediate_size"),
    ("dflash", "dflash", "dflash_config.target_layer_ids", lambda v: v[::-1], "target_layer_ids"),
    ("dflash", "dflash", "block_size", lambda v: v + 1, "block_size"),
    ("eagle1", "eagle", "rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
    ("eagle1", "eagle", "intermediate_size", lambda v: v * 2, "intermediate_size"),
    ("medusa", "medusa", "truncated_vocab_size", lambda v: v // 2, "draft_vocab_size"),
    ("mtp", "mtp", "rms_norm_eps", lambda v: 0.1, "rms_norm_eps"),
]


@pytest.mark.parametrize("method,fmt,path,change,name", SERVED_FIELDS, ids=[f"{m}-{f}-{p}" for m, f, p, _, _ in SERVED_FIELDS])
def test_an_edited_served_field_is_named(exports, tmp_path, method, fmt, path, change, name):
    folder = _copy(exports, tmp_path, method) if json.loads((exports[method] / "draftsmith.json").read_text())["format"] == fmt \
        else _exported(exports, tmp_path, method, fmt)
    assert all(c.ok for c in run_checks(folder))
    config = json.loads((folder / "config.json").read_text())
    _edit(config, path, change)
    (folder / "config.json").write_text(json.dumps(config))
    semantics = next(c for c in run_checks(folder) if c.level == "b")
    assert not semantics.ok and name in semantics.line(), semantics.line()


def test_parity_is_computed_from_the_served_config(exports, tmp_path):
    """An eps only config.json states moves the served drafter's outputs: (c) sees it too."""
    folder = _copy(exports, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"]["rms_norm_eps"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    parity = next(c for c in run_checks(folder) if c.level == "c")
    assert not parity.ok and "max abs diff" in parity.line()
