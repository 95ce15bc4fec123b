"""Each export against what its server reads (docs/serving.md cites the loader files and the
wheel versions): keys read, defaults a server takes silently, tensor names after the server's
renaming, shapes, causal flags and layer-id indexing. The contract is written here as data and
small functions that restate the loaders' behaviour; no server is imported."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

TARGET = "tiny-random-llama"

# vLLM 0.33 model registry entries for the speculative methods exported here
# (vllm/model_executor/models/registry.py)
VLLM033_DRAFT_ARCHS = {"EagleLlamaForCausalLM", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "DFlashDraftModel"}


# ---------------------------------------------------------------- the contracts, as data
def vllm_speculators_view(config: dict) -> dict:
    """The HF config vLLM 0.33 builds from a speculators config.json
    (transformers_utils/configs/speculators/{base,algos}.py): the layer config, plus the
    method's fields with vLLM's defaults for absent keys."""
    view = dict(config["transformer_layer_config"])
    kind = config["speculators_model_type"]
    if kind == "eagle3":
        view["draft_vocab_size"] = config.get("draft_vocab_size")
        view["norm_before_residual"] = config.get("norm_before_residual", True)
        view["norm_before_fc"] = config.get("norm_before_fc", False)
        view["fc_norm"] = config.get("fc_norm", False)
        view["norm_output"] = config.get("norm_output", False)
        view["eagle_aux_hidden_state_layer_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    elif kind == "dflash":
        aux = config["aux_hidden_state_layer_ids"]
        view["draft_vocab_size"] = config.get("draft_vocab_size")
        view["eagle_aux_hidden_state_layer_ids"] = aux
        view["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                                 "sample_from_anchor": config.get("sample_from_anchor", False),
                                 "causal": not config.get("sliding_window_non_causal", True)}
    view["num_speculative_tokens"] = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return view


def vllm_dflash_layer_causal(view: dict, layer: int) -> bool:
    """qwen3_dflash.py `_dflash_layer_causal`: is_causal first, then dflash_config.causal,
    then layer_types."""
    if view.get("is_causal") is not None:
        return bool(view["is_causal"])
    if view["dflash_config"].get("causal") is not None:
        return bool(view["dflash_config"]["causal"])
    types = view.get("layer_types")
    return bool(types) and types[layer] == "sliding_attention"


def vllm_captured_hidden_states(ids) -> tuple:
    """interfaces.py `_set_aux_hidden_state_layers`: sorted, de-duplicated HF hidden_states
    indices; the target appends them in layer order."""
    return tuple(sorted(set(ids)))


def sglang_captured_layers(ids) -> list:
    """SGLang llama.py: captures the input of layer id + 1 (= output of id) in layer order."""
    return sorted(i + 1 for i in ids)


def vllm_eagle_arch(arch: str) -> str:
    """transformers_utils/configs/eagle.py, method 'eagle': Eagle{arch} unless it starts with Eagle."""
    return arch if arch.startswith("Eagle") else f"Eagle{arch}"


# ---------------------------------------------------------------- tiny drafters shaped like the tiny target
@pytest.fixture(scope="module")
def hf_config():
    from models.zoo import resolve_target

    return AutoConfig.from_pretrained(resolve_target(TARGET))


def _random(drafter, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1)
    vd, v = drafter.config.draft_vocab_size, drafter.config.vocab_size
    ids = torch.sort(torch.randperm(v)[:vd]).values
    drafter.d2t.copy_(ids - torch.arange(vd))
    drafter.t2d.zero_().index_fill_(0, ids, True)
    return drafter.eval()


def eagle3(hf_config, vd=512, **options):
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    return _random(Eagle3Drafter(Eagle3Config.from_target(hf_config, vd, **options)))


def dflash(hf_config, vd=None):
    from models.dflash import DFlashConfig, DFlashDrafter

    return _random(DFlashDrafter(DFlashConfig.from_target(hf_config, vd or hf_config.vocab_size, 3, num_layers=2,
                                                          block_size=4, target_layer_ids=[0, 1])))


def _read(folder):
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


# ---------------------------------------------------------------- row: DFlash speculators is causal in vLLM
def test_dflash_speculators_layers_are_non_causal_in_vllm(hf_config, tmp_path):
    from export.speculators import export_speculators

    export_speculators(dflash(hf_config), tmp_path / "d", target_name=TARGET, target_arch=["LlamaForCausalLM"])
    config, _ = _read(tmp_path / "d")
    view = vllm_speculators_view(config)
    assert not any(vllm_dflash_layer_causal(view, i) for i in range(view["num_hidden_layers"]))
    assert config["transformer_layer_config"]["is_causal"] is False
    assert view["dflash_config"]["target_layer_ids"] == [0, 1]  # vLLM's -1 gives back the trained ids
    assert view["num_speculative_tokens"] == 3  # B - 1: vLLM ignores block_size


# ---------------------------------------------------------------- row: the verifier is a zoo alias
def test_speculators_verifier_is_the_upstream_hub_id_or_a_local_path(hf_config, tmp_path):
    from export.speculators import export_speculators
    from models.zoo import resolve_target, served_target_name

    assert served_target_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    export_speculators(eagle3(hf_config), tmp_path / "z", target_name="smollm2-135m-instruct", target_arch=["LlamaForCausalLM"])
    assert _read(tmp_path / "z")[0]["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    local = resolve_target(TARGET)
    export_speculators(eagle3(hf_config), tmp_path / "l", target_name=TARGET, target_arch=["LlamaForCausalLM"])
    name = _read(tmp_path / "l")[0]["speculators_config"]["verifier"]["name_or_path"]
    assert name == local and not name.startswith("tiny-random")  # a local target keeps its path


# ---------------------------------------------------------------- row: EAGLE-1 in vLLM
def _eagle1(hf_config, vd=None, fc_bias=True):
    from models.eagle1 import Eagle1Config, Eagle1Drafter

    return _random(Eagle1Drafter(Eagle1Config.from_target(hf_config, vd or hf_config.vocab_size, fc_bias=fc_bias)))


def test_eagle1_vllm_layout_is_what_vllms_eagle_method_loads(hf_config, tmp_path):
    from export.formats import write_export

    d = _eagle1(hf_config, fc_bias=False)
    write_export(d, "eagle-vllm", tmp_path / "v", method="eagle1", target_name=TARGET, hf_config=hf_config,
                 target_model=None, joint=False, k=3, provenance=None, dtype=torch.float32)
    config, tensors = _read(tmp_path / "v")
    assert vllm_eagle_arch(config["architectures"][0]) in VLLM033_DRAFT_ARCHS
    # llama.py: attention_bias or bias creates q/k/v/o biases the file never fills
    assert not config.get("bias", False) and not config.get("attention_bias", False)
    H, L = hf_config.hidden_size, 0
    # llama_eagle.py: every name but lm_head gets "model."; fc has no bias; layer 0 has no input norm
    names = {("model." + n if "lm_head" not in n else n) for n in tensors}
    assert "model.fc.bias" not in names and tensors["fc.weight"].shape == (H, 2 * H)
    assert f"model.layers.{L}.input_layernorm.weight" not in names
    assert {f"model.layers.{L}.self_attn.{p}_proj.weight" for p in "qkvo"} <= names
    assert not {"d2t", "t2d"} & set(tensors)  # vLLM's eagle method drafts over the full vocabulary


def test_eagle1_vllm_layout_refuses_what_vllm_cannot_compute(hf_config, tmp_path):
    from export.formats import write_export

    for d, word in ((_eagle1(hf_config, fc_bias=True), "fc_bias"), (_eagle1(hf_config, vd=512, fc_bias=False), "draft_vocab_size")):
        with pytest.raises(ValueError, match=rf"vLLM 0\.33.*{word}|{word}.*vLLM 0\.33"):
            write_export(d, "eagle-vllm", tmp_path / word, method="eagle1", target_name=TARGET, hf_config=hf_config,
                         target_model=None, joint=False, k=3, provenance=None)
        assert not (tmp_path / word).exists()


def test_eagle1_sglang_layout_has_no_bias_flag_and_ships_the_fc_bias(hf_config, tmp_path):
    from export.formats import write_export

    write_export(_eagle1(hf_config), "eagle", tmp_path / "s", method="eagle1", target_name=TARGET, hf_config=hf_config,
                 target_model=None, joint=False, k=3, provenance=None)
    config, tensors = _read(tmp_path / "s")
    assert config["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's EAGLE-1 class
    assert "bias" not in config and "fc.bias" in tensors  # SGLang's fc always has a bias; `bias` would add attention biases


# ---------------------------------------------------------------- row: Medusa in vLLM
def _medusa(hf_config, vd):
    from models.medusa import MedusaConfig, MedusaDrafter

    return _random(MedusaDrafter(MedusaConfig(vocab_size=hf_config.vocab_size, draft_vocab_size=vd, hidden_size=hf_config.hidden_size,
                                              target_num_layers=hf_config.num_hidden_layers, num_heads=3, num_layers=1)))


def test_medusa_for_vllm_has_full_vocabulary_heads(hf_config, tmp_path):
    from export.medusa import export_medusa

    V, H = hf_config.vocab_size, hf_config.hidden_size
    export_medusa(_medusa(hf_config, V), tmp_path / "m", target_name=TARGET)
    config, tensors = _read(tmp_path / "m")
    # vLLM 0.32 medusa.py: heads ParallelLMHead(vocab_size); truncated < vocab needs a token_map
    assert config["truncated_vocab_size"] == config["vocab_size"] == V and "token_map" not in tensors
    assert all(tensors[f"lm_heads.{i}.weight"].shape == (V, H) for i in range(3))
    assert config["medusa_fc_bias"] is True and tensors["blocks.0.layers.0.bias"].shape == (H,)


def test_medusa_with_a_draft_vocabulary_is_refused_naming_the_vllm_versions(hf_config, tmp_path):
    from export.medusa import export_medusa

    with pytest.raises(ValueError, match=r"vLLM 0\.33.*0\.32|0\.32.*vLLM 0\.33"):
        export_medusa(_medusa(hf_config, 512), tmp_path / "m", target_name=TARGET)
    assert not (tmp_path / "m").exists()
    # draftsmith's own runtime still gets its export (the training run writes it)
    export_medusa(_medusa(hf_config, 512), tmp_path / "r", target_name=TARGET, runtime_only=True)
    assert "draftsmith" in json.loads((tmp_path / "r" / "draftsmith.json").read_text())["served_by"]


# ---------------------------------------------------------------- row: MTP on a Llama target
def test_mtp_export_says_only_draftsmith_serves_it(hf_config, tiny_target, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from export.formats import write_export
    from models.mtp import MTPConfig, MTPDrafter

    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    d = _random(MTPDrafter(MTPConfig.from_target(hf_config, hf_config.vocab_size, 1)))
    write_export(d, "mtp", tmp_path / "t", method="mtp", target_name=TARGET, hf_config=hf_config, target_model=target,
                 joint=False, k=1, provenance=None, dtype=torch.float32)
    out = capsys.readouterr().out
    assert "draftsmith runtime only" in out and "vLLM 0.33" in out and "SGLang 0.5.23" in out
    assert json.loads((tmp_path / "t" / "draftsmith.json").read_text())["served_by"] == ["draftsmith"]


# ---------------------------------------------------------------- row: SGLang and the norm flags
def _sglang_params(config: dict, H: int, n_aux: int) -> dict:
    """Parameter names and shapes of SGLang 0.5.23's LlamaForCausalLMEagle3 (llama_eagle3.py),
    before q/k/v and gate/up are stacked."""
    I, nh, nkv = config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = H // nh
    p = {"model.embed_tokens.weight": (config["vocab_size"], H), "model.fc.weight": (H, n_aux * H), "model.norm.weight": (H,),
         "lm_head.weight": (config["draft_vocab_size"], H), "model.layers.0.hidden_norm.weight": (H,),
         "model.layers.0.input_layernorm.weight": (H,), "model.layers.0.post_attention_layernorm.weight": (H,),
         "model.layers.0.self_attn.q_proj.weight": (nh * d, 2 * H), "model.layers.0.self_attn.k_proj.weight": (nkv * d, 2 * H),
         "model.layers.0.self_attn.v_proj.weight": (nkv * d, 2 * H), "model.layers.0.self_attn.o_proj.weight": (H, nh * d),
         "model.layers.0.mlp.gate_proj.weight": (I, H), "model.layers.0.mlp.up_proj.weight": (I, H),
         "model.layers.0.mlp.down_proj.weight": (H, I)}
    if (config.get("eagle_config") or {}).get("norm_before_fc", config.get("norm_before_fc", False)):
        p["model.input_norm.weight"] = (n_aux * H,)
    return p


def test_sglang_carries_norm_before_fc(hf_config, tmp_path):
    from export.sglang import export_sglang

    d = eagle3(hf_config, norm_before_fc=True, norm_before_residual=False)
    export_sglang(d, tmp_path / "s", target_name=TARGET)
    config, tensors = _read(tmp_path / "s")
    expected = _sglang_params(config, hf_config.hidden_size, len(d.config.aux_layer_ids))
    # SGLang renames midlayer -> layers.0, prefixes model., reads d2t, skips t2d and unknown names silently
    loaded = {}
    for name, t in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        name = name.replace("midlayer", "layers.0")
        loaded[name if name.startswith("lm_head") else "model." + name] = tuple(t.shape)
    assert loaded == expected  # nothing skipped, nothing left at its random init


def test_sglang_refuses_norm_before_residual_naming_the_version(hf_config, tmp_path):
    from export.sglang import UnsupportedOption, export_sglang

    with pytest.raises(UnsupportedOption, match=r"norm_before_residual.*SGLang 0\.5\.23"):
        export_sglang(eagle3(hf_config, norm_before_residual=True), tmp_path / "s", target_name=TARGET)


# ---------------------------------------------------------------- row: aux layer order
@pytest.mark.parametrize("ids", [[1, 0], [1, 1]])
def test_aux_layer_ids_must_be_strictly_increasing(hf_config, ids):
    from models.dflash import DFlashConfig
    from models.eagle3 import Eagle3Config

    # a server captures them sorted and de-duplicated: any other order trains one thing and serves another
    assert list(vllm_captured_hidden_states([i + 1 for i in ids])) != [i + 1 for i in ids]
    with pytest.raises(ValueError, match="strictly increasing"):
        Eagle3Config.from_target(hf_config, 512, ids)
    with pytest.raises(ValueError, match="strictly increasing"):
        DFlashConfig.from_target(hf_config, 512, 3, target_layer_ids=ids)


def test_default_layer_ids_are_strictly_increasing_on_small_targets():
    from models.dflash import default_target_layer_ids
    from models.eagle3 import default_aux_layer_ids

    for L in (2, 3, 4, 5, 8, 30):
        for ids in (default_aux_layer_ids(L), default_target_layer_ids(L)):
            assert ids == sorted(set(ids)) and all(0 <= i < L for i in ids), (L, ids)


def test_served_aux_ids_are_the_trained_ones_in_both_servers(hf_config, tmp_path):
    from export.sglang import export_sglang
    from export.speculators import export_speculators

    d = eagle3(hf_config)
    export_speculators(d, tmp_path / "v", target_name=TARGET, target_arch=["LlamaForCausalLM"])
    export_sglang(d, tmp_path / "s", target_name=TARGET)
    v, s = _read(tmp_path / "v")[0], _read(tmp_path / "s")[0]
    assert [i - 1 for i in vllm_captured_hidden_states(v["eagle_aux_hidden_state_layer_ids"])] == d.config.aux_layer_ids
    assert [i - 1 for i in sglang_captured_layers(s["eagle_config"]["eagle_aux_hidden_state_layer_ids"])] == d.config.aux_layer_ids


# ---------------------------------------------------------------- row: EAGLE-3's fc width in vLLM
def vllm_eagle3_fc_input(view: dict) -> int:
    """llama_eagle3.py:210-221 (vLLM 0.33): fc takes target_hidden_size x num_aux_hidden_states
    inputs, the count read from the layer config, else from eagle_config's ids, else 3 (the
    speculators view has no eagle_config: its top-level ids do not count)."""
    n = view.get("num_aux_hidden_states")
    if n is None:
        ids = (view.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return view.get("target_hidden_size", view["hidden_size"]) * n


@pytest.mark.parametrize("ids", [[0, 1], [0, 1, 2, 3]], ids=["2-aux", "4-aux"])
def test_eagle3_speculators_export_sizes_vllms_fc_for_its_aux_layers(hf_config, tmp_path, ids):
    from export.check import served_problems
    from export.formats import layout_module
    from export.speculators import export_speculators

    cfg = hf_config.to_dict() | {"num_hidden_layers": 6}
    d = eagle3(type(hf_config)(**cfg), aux_layer_ids=ids)
    export_speculators(d, tmp_path / "v", target_name=TARGET, target_arch=["LlamaForCausalLM"], k=3)
    config, tensors = _read(tmp_path / "v")
    view = vllm_speculators_view(config)
    view["target_hidden_size"] = config["target_hidden_size"]
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == len(ids)
    assert tensors["fc.weight"].shape[1] == vllm_eagle3_fc_input(view)  # the file's fc loads into vLLM's
    meta = json.loads((tmp_path / "v" / "draftsmith.json").read_text())
    layout = layout_module("eagle3", "speculators")
    assert served_problems(tmp_path / "v", layout, meta, config) == []
    del config["transformer_layer_config"]["num_aux_hidden_states"]  # as exports before this field: vLLM builds 3
    assert tensors["fc.weight"].shape[1] != vllm_eagle3_fc_input(vllm_speculators_view(config) | {"target_hidden_size": config["target_hidden_size"]})
    problems = served_problems(tmp_path / "v", layout, meta, config)
    assert any("num_aux_hidden_states" in p and f"expected {len(ids)}" in p for p in problems), problems


# ---------------------------------------------------------------- row: EAGLE-1 for vLLM, trained
@pytest.mark.parametrize("vd", [49152, 256], ids=["full-vocab", "draft-vocab"])
def test_eagle1_without_fc_bias_trains_to_an_export_that_passes_the_check(tmp_path, vd):
    """`drafter.eagle1.fc_bias=false` (vLLM's EAGLE-1): the run's auto export is `eagle-vllm`
    (`eagle`, SGLang's, always has an fc bias and refuses it); with Vd < V no server computes it and
    the export is for draftsmith's runtime. Either passes export.check."""
    from export.check import run_checks
    from tests.conftest import make_conversations, tiny_overrides
    from train.config import load_config
    from train.run import run

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(60)))
    overrides = tiny_overrides(str(chat), tmp_path / "run", **{"trainer.max_steps": 2, "trainer.precision": "32-true"})
    run(load_config("configs/eagle1.yaml", [*overrides, "drafter.eagle1.fc_bias=false", f"drafter.draft_vocab_size={vd}"]))
    export = tmp_path / "run" / "export"
    meta = json.loads((export / "draftsmith.json").read_text())
    assert meta["format"] == "eagle-vllm" and meta["drafter_config"]["fc_bias"] is False
    assert meta["served_by"] == (["vllm==0.33", "draftsmith"] if vd == 49152 else ["draftsmith"])
    checks = run_checks(export)
    assert all(c.ok for c in checks), [c.line() for c in checks]


# ---------------------------------------------------------------- row: SGLang EAGLE-1 with a draft vocabulary
def test_eagle1_sglang_export_with_a_draft_vocabulary_carries_its_token_map(hf_config, tmp_path):
    """SGLang 0.5.23's EAGLE-1 reads no d2t: it drafts over the target's whole head unless given
    --speculative-token-map, whose ids pick the head's rows (eagle_worker_v2.py init_lm_head) and
    map draft row i back to target token hot[i]. The export writes them and its line passes them."""
    from export.formats import launch_lines, write_export

    d = _eagle1(hf_config, vd=512)
    write_export(d, "eagle", tmp_path / "s", method="eagle1", target_name=TARGET, hf_config=hf_config, target_model=None,
                 joint=False, k=3, provenance={"target": TARGET, "training_config": {"eval": {"k": 3}}})
    hot = torch.load(tmp_path / "s" / "hot_token_ids.pt", weights_only=True)
    assert hot.dtype == torch.int64 and torch.equal(hot, d.draft_ids())  # row i drafts target token i + d2t[i]
    (line,) = launch_lines(tmp_path / "s")
    assert f"--speculative-token-map {tmp_path / 's' / 'hot_token_ids.pt'}" in line
    write_export(_eagle1(hf_config), "eagle", tmp_path / "f", method="eagle1", target_name=TARGET, hf_config=hf_config,
                 target_model=None, joint=False, k=3, provenance={"target": TARGET, "training_config": {"eval": {"k": 3}}})
    assert not (tmp_path / "f" / "hot_token_ids.pt").exists() and "--speculative-token-map" not in launch_lines(tmp_path / "f")[0]
