"""DSpark exports against what vLLM 0.33 (`dspark`) and SGLang 0.5.23 (`DSPARK`) read (issue 53,
item 2; docs/serving.md "DSpark" cites each loader line). tests/dspark_forward.py restates the
loaders (config views, which parameters the tensors fill, the forward); here every export of a
tiny random DSpark drafter is held to them, and each field and tensor group, edited away from
what was written, is shown to break the contract (the mutation list below)."""
import json
import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.dspark_forward import reference_block, sglang_load, sglang_view, vllm_load, vllm_view
from tests.test_launch_lines import place_target, sglang_path, vllm_path  # noqa: F401 (fixtures)

TARGET = "tiny-random-llama"
B, RANK, LAYER_IDS, MASK = 4, 8, [0, 1], 3
TOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    from models.zoo import resolve_target

    return AutoConfig.from_pretrained(resolve_target(TARGET))


@pytest.fixture(scope="module")
def target():
    from export.io import target_embedding_and_head

    return target_embedding_and_head(TARGET)


def make_drafter(hf, target, vd=None, confidence=True, with_markov=True, seed=0):
    """A random DSpark drafter on the tiny target, its embedding and head rows the target's."""
    from models.dspark import DSparkConfig, DSparkDrafter

    V = hf.vocab_size
    vd = vd or V
    cfg = DSparkConfig.from_target(hf, vd, MASK, num_layers=1, block_size=B, target_layer_ids=LAYER_IDS, markov_rank=RANK,
                                   confidence_head=confidence, confidence_with_markov=with_markov)
    drafter = DSparkDrafter(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():  # norms near 1, as trained ones are: attention then depends on position
            if name not in ("embed_tokens.weight", "lm_head.weight"):  # (the target's, below)
                p.normal_(0, 0.1).add_(1.0 if p.dim() == 1 and p.numel() > 1 else 0.0)
        ids = torch.sort(torch.randperm(V)[:vd]).values if vd < V else torch.arange(V)
        drafter.d2t.copy_(ids - torch.arange(vd))
        drafter.t2d.zero_().index_fill_(0, ids, True)
        embed, head = target
        drafter.embed_tokens.weight.copy_(embed)
        drafter.lm_head.weight.copy_(head[ids])
    return drafter.eval()


def write(drafter, folder, fmt):
    from export.dspark import export_dspark

    return export_dspark(drafter, folder, fmt, target_name=TARGET, target_arch=["LlamaForCausalLM"], dtype=torch.float32)


CASES = {"dspark": ("dspark", None), "dspark-vd": ("dspark", 512), "speculators": ("speculators", None),
         "speculators-vd": ("speculators", 512), "dspark-no-markov-conf": ("dspark", None)}


@pytest.fixture(scope="module")
def exports(hf, target, tmp_path_factory):
    """name -> (folder, drafter) for each case."""
    root = tmp_path_factory.mktemp("dspark")
    out = {}
    for name, (fmt, vd) in CASES.items():
        drafter = make_drafter(hf, target, vd=vd, with_markov=not name.endswith("no-markov-conf"))
        out[name] = (write(drafter, root / name, fmt), drafter)
    return out


# ---------------------------------------------------------------- the contract, as one function
def lines_of(folder):
    from export.dspark import launch_lines

    config = json.loads((folder / "config.json").read_text())
    meta = json.loads((folder / "draftsmith.json").read_text())
    return launch_lines(str(folder), config, meta)


def line_tokens(lines):
    """(vLLM's num_speculative_tokens, SGLang's --speculative-num-draft-tokens or None) of the lines."""
    vllm = [json.loads(shlex.split(line)[shlex.split(line).index("--speculative-config") + 1]) for line in lines
            if line.startswith("vllm serve")]
    sgl = [shlex.split(line) for line in lines if "sglang" in line]
    assert len(vllm) == 1 and vllm[0]["method"] == "dspark", lines
    return vllm[0]["num_speculative_tokens"], (int(sgl[0][sgl[0].index("--speculative-num-draft-tokens") + 1]) if sgl else None)


def served_by_sglang(drafter) -> bool:
    # SGLang's DSpark has no draft vocabulary: its head and markov_w2 are the target's V wide
    return drafter.config.draft_vocab_size == drafter.config.vocab_size


def contract_problems(folder, drafter, target) -> list[str]:
    """Every way a server would load `folder` otherwise than `drafter` computes: the config as
    vLLM (and SGLang, for the layout it serves) reads it, the parameters the tensors fill, and
    the block each builds (greedy and teacher-forced) against draftsmith's module."""
    cfg = drafter.config
    config = json.loads((folder / "config.json").read_text())
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    problems = []
    tokens, window = line_tokens(lines_of(folder))
    trained = {"architecture": "Qwen3DSparkModel", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
               "num_layers": cfg.num_layers, "markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
               "mask_token_id": cfg.mask_token_id, "confidence_head": cfg.confidence_head,
               "confidence_with_markov": cfg.confidence_head and cfg.confidence_with_markov, "sample_from_anchor": False,
               "causal": [False] * cfg.num_layers}
    try:
        view = vllm_view(config, tokens)
        want = {**trained, "draft_vocab_size": cfg.draft_vocab_size, "aux_hidden_states": tuple(i + 1 for i in LAYER_IDS),
                "drafts": B - 1, "use_aux_hidden_state": True, "logit_scale": 1.0}
        problems += [f"vLLM reads {k} = {view[k]!r}, trained {v!r}" for k, v in want.items() if view[k] != v]
        problems += vllm_load(config, shapes, cfg.vocab_size)
    except (KeyError, ValueError, TypeError) as e:
        problems.append(f"vLLM cannot read config.json: {e!r}")
    if window is not None or (not config.get("speculators_config") and served_by_sglang(drafter)):
        try:
            view = sglang_view(config, window)
            want = {**trained, "gamma": B - 1, "target_layer_ids": LAYER_IDS}
            problems += [f"SGLang reads {k} = {view[k]!r}, trained {v!r}" for k, v in want.items() if view[k] != v]
            problems += sglang_load(config, shapes)
        except (KeyError, ValueError, TypeError) as e:
            problems.append(f"SGLang cannot read config.json: {e!r}")
        if window is None:
            problems.append("no SGLang line for an export SGLang serves")
    if problems:
        return problems
    return parity_problems(folder, drafter, target)


def parity_problems(folder, drafter, target) -> list[str]:
    """The block the servers compute from the folder against draftsmith's module (one anchor, past
    the context's start), greedy and teacher-forced."""
    torch.manual_seed(1)
    cfg = drafter.config
    T = 12
    ids = torch.randint(0, cfg.vocab_size, (T,))
    features = torch.randn(T, len(LAYER_IDS) * cfg.hidden_size)
    problems = []
    for a in (7,):
        anchors = torch.tensor([a])
        seen = []
        with torch.no_grad():
            tokens, conf = drafter.draft_block(ids, features, anchors, B - 1,
                                               pick=lambda logits, j: seen.append(logits[0]) or drafter.draft_ids()[logits.argmax(-1)])
            forced_logits, forced_conf = drafter.block_outputs(ids, features, anchors)
            try:
                ref = reference_block(folder, *target, ids, features, a)
                forced = reference_block(folder, *target, ids, features, a, forced=ids[a + 1: a + B])
            except KeyError as e:
                return [f"the served drafter lacks tensor {e}"]
        pairs = [("greedy logits", ref["logits"], torch.stack(seen)), ("forced logits", forced["logits"], forced_logits[0, 1:])]
        if not torch.equal(ref["tokens"], tokens[0]):
            problems.append(f"anchor {a}: the servers draft {ref['tokens'].tolist()}, draftsmith {tokens[0].tolist()}")
        if (ref["confidence"] is None) != (conf is None):
            problems.append(f"anchor {a}: confidence head {'missing' if ref['confidence'] is None else 'extra'} in the served drafter")
        elif conf is not None:
            pairs += [("confidence", ref["confidence"], conf[0]), ("forced confidence", forced["confidence"],
                                                                   torch.sigmoid(forced_conf[0, 1:]))]
        for what, theirs, ours in pairs:
            if theirs.shape != ours.shape or (theirs - ours).abs().max().item() > TOL:
                diff = (theirs - ours).abs().max().item() if theirs.shape == ours.shape else "shape"
                problems.append(f"anchor {a}: {what} differ ({diff})")
    return problems


# ---------------------------------------------------------------- every export as written
@pytest.mark.parametrize("case", list(CASES))
def test_each_export_is_served_as_trained(exports, target, case):
    folder, drafter = exports[case]
    assert contract_problems(folder, drafter, target) == []


def test_launch_lines_name_the_servers_that_compute_it(exports):
    assert line_tokens(lines_of(exports["dspark"][0])) == (B - 1, B)  # vLLM B - 1 drafts; SGLang a window of B
    assert line_tokens(lines_of(exports["dspark-vd"][0])) == (B - 1, None)  # SGLang's DSpark has no draft vocabulary
    assert line_tokens(lines_of(exports["speculators"][0])) == (B - 1, None)  # SGLang reads no speculators config


def test_the_layouts_read_back_strictly(exports):
    """export.load (draftsmith.json's config, and config.json alone as a server reads it) gives the drafter back."""
    from export.dspark import load_dspark, served_config

    for case in ("dspark", "speculators-vd"):
        folder, drafter = exports[case]
        config = json.loads((folder / "config.json").read_text())
        served = served_config(config, folder).to_dict()
        trained = drafter.config.to_dict()
        assert {k: served[k] for k in trained if k != "target_num_layers" and k not in ("confidence_weight", "confidence_target")} == \
               {k: trained[k] for k in trained if k != "target_num_layers" and k not in ("confidence_weight", "confidence_target")}, case
        for as_served in (False, True):
            back = load_dspark(folder, served=as_served)
            ours = drafter.state_dict()
            assert all(torch.equal(v, ours[k]) for k, v in back.state_dict().items()), case


# ---------------------------------------------------------------- each field, edited, breaks it
def _edit_config(fn):
    def apply(folder):
        config = json.loads((folder / "config.json").read_text())
        fn(config)
        (folder / "config.json").write_text(json.dumps(config))
    return apply


def _edit_tensors(fn):
    def apply(folder):
        state = load_file(str(folder / "model.safetensors"))
        fn(state)
        save_file(state, str(folder / "model.safetensors"))
    return apply


def _rename(old, new):
    return _edit_tensors(lambda s: s.update({new: s.pop(old)}))


def _set(key, value):
    return _edit_config(lambda c: c.update({key: value}))


def _drop(key):
    return _edit_config(lambda c: c.pop(key))


def _layer(key, value):
    return _edit_config(lambda c: c["transformer_layer_config"].update({key: value}))


MUTATIONS = {  # case -> {what is edited: the edit}
    "dspark": {
        "architectures": _set("architectures", ["DFlashDraftModel"]),
        "markov_rank": _set("markov_rank", RANK // 2),
        "markov_head_type": _set("markov_head_type", "gated"),
        "markov_head_type absent": _drop("markov_head_type"),
        "enable_confidence_head absent": _drop("enable_confidence_head"),
        "confidence_head_with_markov": _set("confidence_head_with_markov", False),
        "sample_from_anchor absent": _drop("sample_from_anchor"),
        "is_causal": _set("is_causal", True),
        "block_size = B": _set("block_size", B),
        "mask_token_id": _edit_config(lambda c: c["dflash_config"].update(mask_token_id=MASK + 1)),
        "target_layer_ids": _edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[1])),
        "vocab_size": _set("vocab_size", 1000),
        "num_hidden_layers": _set("num_hidden_layers", 2),
        "rope_theta": _set("rope_theta", 10000.0),
        "logit_scale": _set("logit_scale", 2.0),
        "markov_w1 name": _rename("markov_head.markov_w1.weight", "markov_w1.weight"),
        "markov_w2 name": _rename("markov_head.markov_w2.weight", "model.markov_head.markov_w2"),
        "markov_w2 as [r, V]": _edit_tensors(lambda s: s.update({"markov_head.markov_w2.weight":
                                                                  s["markov_head.markov_w2.weight"].T.contiguous()})),
        "markov_w1 values": _edit_tensors(lambda s: s["markov_head.markov_w1.weight"].mul_(2)),
        "confidence weight name": _rename("confidence_head.proj.weight", "confidence_head.weight"),
        "confidence bias absent": _edit_tensors(lambda s: s.pop("confidence_head.proj.bias")),
        "confidence values": _edit_tensors(lambda s: s["confidence_head.proj.bias"].add_(1)),
        "fc name": _rename("fc.weight", "fc_proj.weight"),
        "q_proj name": _rename("layers.0.self_attn.q_proj.weight", "layers.0.attn.q_proj.weight"),
        "k_norm name": _rename("layers.0.self_attn.k_norm.weight", "layers.0.self_attn.key_norm.weight"),
        "hidden_norm values": _edit_tensors(lambda s: s["hidden_norm.weight"].mul_(2)),
        "maps for a full vocabulary": _edit_tensors(lambda s: s.update(d2t=torch.zeros(s["markov_head.markov_w1.weight"].shape[0],
                                                                                       dtype=torch.long))),
    },
    "dspark-vd": {
        "draft_vocab_size absent": _drop("draft_vocab_size"),
        "d2t absent": _edit_tensors(lambda s: s.pop("d2t")),
        "lm_head absent": _edit_tensors(lambda s: s.pop("lm_head.weight")),
        "d2t values": _edit_tensors(lambda s: s["d2t"].copy_(torch.roll(s["d2t"], 1))),
    },
    "dspark-no-markov-conf": {
        "confidence_head_with_markov absent": _drop("confidence_head_with_markov"),
    },
    "speculators": {
        "speculators_model_type": _set("speculators_model_type", "dflash"),
        "aux_hidden_state_layer_ids unshifted": _set("aux_hidden_state_layer_ids", LAYER_IDS),
        "speculative_tokens = B": _edit_config(lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=B)),
        "sample_from_anchor": _set("sample_from_anchor", True),
        "enable_confidence_head absent": _drop("enable_confidence_head"),
        "confidence_head_with_markov absent": _drop("confidence_head_with_markov"),
        "transformer_layer_config.is_causal": _layer("is_causal", True),
        "mask_token_id": _set("mask_token_id", MASK + 1),
        "markov_rank": _set("markov_rank", RANK * 2),
    },
}


@pytest.mark.parametrize("case,what", [(c, w) for c, edits in MUTATIONS.items() for w in edits])
def test_an_export_edited_away_from_the_contract_fails_it(exports, target, tmp_path, case, what):
    folder, drafter = exports[case]
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    MUTATIONS[case][what](edited)
    assert contract_problems(edited, drafter, target) != [], what


# ---------------------------------------------------------------- the printed lines, through the servers' argument code
SGLANG_PARSE = """
import json, shlex, sys
from tests.sglang_args import PREFIX, _prepare_imports
_prepare_imports()
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import prepare_server_args
out = []
for line in json.loads(sys.argv[1]):
    view = resolving_view(prepare_server_args(shlex.split(line)[len(PREFIX):]))
    out.append({name: getattr(view, name) for name in ("speculative_algorithm", "speculative_draft_model_path",
                                                       "speculative_num_draft_tokens", "speculative_dspark_block_size")})
print(json.dumps(out))
"""


VLLM_READ = """
import importlib.util, json, shlex, sys
from tests.sglang_args import _EmptyFinder
from tests.vllm_args import ABSENT_OK, resolve
sys.meta_path.insert(0, _EmptyFinder([n for n in ABSENT_OK if importlib.util.find_spec(n) is None]))
from vllm.transformers_utils.config import get_config
KEYS = ("architectures", "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
        "sample_from_anchor", "eagle_aux_hidden_state_layer_ids", "target_layer_ids", "dflash_config", "mask_token_id",
        "is_causal", "layer_types", "rope_parameters", "draft_vocab_size", "vocab_size", "logit_scale")
out = []
for line in json.loads(sys.argv[1]):
    words = shlex.split(line)
    draft = get_config(json.loads(words[words.index("--speculative-config") + 1])["model"], trust_remote_code=False)
    out.append({**resolve(line), "config": {k: getattr(draft, k) for k in KEYS if hasattr(draft, k)}})
print(json.dumps(out))
"""


def _run(script, lines, path):
    import os
    import subprocess
    import sys

    from tests.test_launch_lines import ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT)])}
    res = subprocess.run([sys.executable, "-c", script, json.dumps(lines)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_printed_lines_resolve_in_sglang_and_vllm(exports, hf, sglang_path, vllm_path, tmp_path):  # noqa: F811
    """SGLang 0.5.23's argument parser on its line (its DSPARK hook, which holds the window to the
    draft's block_size, imports SGLang's kernels and cannot run here: sglang_view restates it,
    speculative_hook.py:816-836); vLLM 0.33's config resolution (tests/vllm_args.py) and its
    get_config on each line's draft: what vLLM's own code reads from the export."""
    from export.dspark import export_dspark
    from models.layers import rope_config

    place_target(tmp_path / "target")
    lines = []
    for case in ("dspark", "speculators"):  # the exports again, for a target at a local path
        fmt, _ = CASES[case]
        export_dspark(exports[case][1], tmp_path / case, fmt, target_name=str(tmp_path / "target"),
                      target_arch=["LlamaForCausalLM"], dtype=torch.float32)
        lines += lines_of(tmp_path / case)
    (sgl,) = [line for line in lines if "sglang" in line]
    (parsed,) = _run(SGLANG_PARSE, [sgl], sglang_path)
    assert parsed == {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": str(tmp_path / "dspark"),
                      "speculative_num_draft_tokens": B, "speculative_dspark_block_size": None}, parsed
    config = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert sglang_view(config, parsed["speculative_num_draft_tokens"])["gamma"] == B - 1
    with pytest.raises(ValueError, match="gamma"):  # a window other than block_size + 1 is refused
        sglang_view(config, B + 1)
    results = _run(VLLM_READ, [line for line in lines if line.startswith("vllm serve")], vllm_path)
    assert len(results) == 2
    for result in results:
        assert "error" not in result, result
        assert (result["method"], result["num_speculative_tokens"], result["draft_architecture"]) == \
               ("dspark", B - 1, "Qwen3DSparkModel"), result
        got = result["config"]
        aux = got.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in (got.get("dflash_config") or {})["target_layer_ids"]]
        mask = (got.get("dflash_config") or {}).get("mask_token_id", got.get("mask_token_id"))
        assert aux == [i + 1 for i in LAYER_IDS] and mask == MASK, got
        assert (got["markov_rank"], got["markov_head_type"], got["enable_confidence_head"], got["confidence_head_with_markov"],
                got["sample_from_anchor"], got["is_causal"], got["draft_vocab_size"]) == \
               (RANK, "vanilla", True, True, False, False, hf.vocab_size), got
        assert got["rope_parameters"]["rope_theta"] == rope_config(hf)[0] and "logit_scale" not in got, got


# ---------------------------------------------------------------- export.check knows both layouts
@pytest.mark.parametrize("fmt", ["dspark", "speculators"])
def test_export_check_passes_both_layouts_and_names_an_edit(hf, target, tmp_path, fmt):
    from export.check import run_checks
    from export.dspark import export_dspark
    from models.checkpoint import describe, section_for_save
    from models.zoo import resolve_target

    drafter = make_drafter(hf, target)
    checkpoint = tmp_path / "last.ckpt"
    section = section_for_save(describe("dspark", TARGET, resolve_target(TARGET), hf, {}), drafter)
    torch.save({"draftsmith": section, "state_dict": {f"drafter.{k}": v for k, v in drafter.state_dict().items()}}, checkpoint)
    folder = export_dspark(drafter, tmp_path / fmt, fmt, target_name=TARGET, target_arch=["LlamaForCausalLM"],
                           provenance={"target": TARGET, "checkpoint": str(checkpoint)})
    checks = run_checks(folder)
    assert [c.level for c in checks] == ["a", "b", "c", "d"] and all(c.ok for c in checks), [c.line() for c in checks]

    def failing(edit):
        edited = tmp_path / f"{fmt}-edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(folder, edited)
        edit(edited)
        return {c.level: c.line() for c in run_checks(edited) if not c.ok}

    # a flag the servers read (vLLM: no confidence head), a key left to their defaults, a head's weights
    assert "vllm.enable_confidence_head" in failing(_set("enable_confidence_head", False)).get("b", "")
    # (absent: the native layout does not build, both servers sampling from the anchor; the
    # speculators one builds, vLLM defaulting it to false, and (d) names the key left out)
    assert "sample_from_anchor" in " ".join(failing(_drop("sample_from_anchor")).values())
    bad = failing(_edit_tensors(lambda s: s["confidence_head.proj.bias"].add_(1)))
    assert "max abs diff" in bad.get("c", "") and "sha256" in bad.get("a", ""), bad


@pytest.mark.parametrize("edit,phrase", [
    ({"markov_rnk": 3}, "drafter_config is not a DSparkConfig (unknown DSparkConfig keys: ['markov_rnk'])"),
    ({"markov_rank": -1}, "drafter_config is not a DSparkConfig (markov_rank -1 must be a positive integer)")])
def test_export_check_refuses_a_drafter_config_draftsmith_would_refuse(exports, tmp_path, capsys, edit, phrase):
    """draftsmith.json's drafter_config is what draftsmith's own loader builds the drafter from: a
    key it does not know or a value it refuses is one error line (exit 2), not a passing check."""
    from export.check import main

    folder = tmp_path / "edited"
    shutil.copytree(exports["dspark"][0], folder)
    meta = json.loads((folder / "draftsmith.json").read_text())
    meta["drafter_config"].update(edit)
    (folder / "draftsmith.json").write_text(json.dumps(meta))
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == [f"error: {folder / 'draftsmith.json'}: {phrase}"], err


def test_export_check_names_a_markov_rank_that_is_no_integer(exports, tmp_path, capsys):
    """config.json's markov_rank as a string ("16"): a failed check naming it, not a TypeError."""
    from export.check import main

    folder = tmp_path / "edited"
    shutil.copytree(exports["dspark"][0], folder)
    _set("markov_rank", str(exports["dspark"][1].config.markov_rank))(folder)
    # (this export records no target: one line asking for it, not an AttributeError)
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {folder / 'draftsmith.json'} records no target; name it with --target"], err
    assert main([str(folder), "--target", TARGET]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "markov_rank: config.json says" in out, out + err
