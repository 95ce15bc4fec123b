"""EAGLE-3.1: the EAGLE-3 flags `drafter.eagle3.fc_norm` (one RMSNorm per aux feature before fc)
and `drafter.eagle3.norm_output` (each draft step fed the final-normed hidden state). They train,
the runtime drafts what training's unroll drafts with them on (chains and trees, lossless), and
both export layouts write them as the servers read them: each name below is restated from the
loader's code (vLLM 0.33 llama_eagle3.py and speculators/algos.py, SGLang 0.5.23 llama_eagle3.py;
docs/serving.md cites the lines), so a wrong name in an export fails here."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from models.eagle3 import Eagle3Config, Eagle3Drafter, ttt_attend, shift_left

TARGET = "tiny-random-llama"
FLAGS = {"fc_norm": True, "norm_output": True}


@pytest.fixture(scope="module")
def hf_config():
    from models.zoo import resolve_target

    return AutoConfig.from_pretrained(resolve_target(TARGET))


def _drafter(hf_config, seed=0, vd=512, **flags) -> Eagle3Drafter:
    """A random drafter; norm weights away from 1 so that each norm's weight shows."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(Eagle3Config.from_target(hf_config, vd, **flags))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "embed" not in name:
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3 if p.dim() == 1 else 0.05)
    v = d.config.vocab_size
    ids = torch.sort(torch.randperm(v)[:vd]).values
    d.d2t.copy_(ids - torch.arange(vd))
    d.t2d.zero_().index_fill_(0, ids, True)
    return d.eval()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inputs(d, T=12, B=2, seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size, (B, T))
    aux = 3 * torch.randn(B, T, d.config.target_hidden_size * len(d.aux_layer_ids))
    return ids, aux


# ---------------------------------------------------------------- the run config and the module
def test_flags_are_run_config_fields_that_build_and_travel_with_the_drafter(tmp_path):
    from models.methods import METHODS
    from train.config import ConfigError, load_config

    cfg = load_config("configs/eagle31.yaml", [])
    options = cfg.drafter.options
    assert (options.fc_norm, options.norm_output, options.norm_before_fc) == (True, True, False)
    plain = load_config("configs/eagle3.yaml", [])
    assert (plain.drafter.options.fc_norm, plain.drafter.options.norm_output) == (False, False)  # default off
    hf = AutoConfig.from_pretrained(__import__("models.zoo", fromlist=["resolve_target"]).resolve_target(TARGET))
    d = METHODS["eagle3"].build(cfg.drafter, hf, 256, 0)
    assert d.config.fc_norm and d.config.norm_output and len(d.fc_norm) == len(d.aux_layer_ids)
    back = Eagle3Config.from_dict(json.loads(json.dumps(d.config.to_dict())))  # as checkpoints and exports store it
    assert back == d.config
    # an older record (no such keys) is the EAGLE-3 it was
    old = {k: v for k, v in d.config.to_dict().items() if k not in FLAGS}
    assert not Eagle3Config.from_dict(old).fc_norm and not Eagle3Config.from_dict(old).norm_output
    with pytest.raises(ConfigError, match=r"drafter\.eagle3\.fc_norm: .*norm_before_fc=false"):
        load_config("configs/eagle31.yaml", ["drafter.eagle3.norm_before_fc=true"])


def test_fc_norm_normalises_each_aux_feature_with_its_own_weight(hf_config):
    """vLLM 0.33 combine_hidden_states (llama_eagle3.py:409-416): the n*Ht input in n chunks,
    chunk i through fc_norm[i], concatenated, then fc."""
    d = _drafter(hf_config, fc_norm=True)
    _, aux = _inputs(d)
    Ht, eps = d.config.target_hidden_size, d.config.rms_norm_eps
    chunks = [_rms(aux[..., i * Ht : (i + 1) * Ht], d.fc_norm[i].weight, eps) for i in range(len(d.aux_layer_ids))]
    expect = torch.cat(chunks, -1) @ d.fc.weight.T
    with torch.no_grad():
        assert torch.allclose(d.fuse(aux), expect, atol=1e-5)
        # not one norm over the concatenation: scaling one feature changes the fused input
        scaled = aux.clone()
        scaled[..., :Ht] *= 10
        assert torch.allclose(d.fuse(scaled), d.fuse(aux), atol=1e-4)  # each chunk is scale-free on its own
        plain = _drafter(hf_config, norm_before_fc=True)
        assert not torch.allclose(plain.fuse(scaled), plain.fuse(aux), atol=1e-3)


def test_norm_output_feeds_the_next_step_the_heads_input(hf_config):
    """vLLM 0.33 LlamaModel.forward (llama_eagle3.py:283-286): the step's output goes to the head
    through the final norm, and with norm_output the normed state, not the pre-norm one, is what
    the next step reads (speculators 0.9 models/eagle3/core.py:302-306 trains the same)."""
    d = _drafter(hf_config, norm_output=True)
    ids, aux = _inputs(d)
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        got = d.unroll(ids, aux, 3)
        attend = ttt_attend([])
        h = d.step(shift_left(ids, 1), d.fuse(aux), pos, attend)
        expect = [d.lm_head(_rms(h, d.norm.weight, d.config.rms_norm_eps))]
        for s in (1, 2):
            h = d.step(shift_left(ids, 1 + s), _rms(h, d.norm.weight, d.config.rms_norm_eps), pos + s, attend)
            expect.append(d.lm_head(_rms(h, d.norm.weight, d.config.rms_norm_eps)))
        for a, b in zip(got, expect):
            assert torch.allclose(a, b, atol=1e-4)
        d.config.norm_output = False  # the same weights without the flag: step 0 alike, later steps not
        off = d.unroll(ids, aux, 2)
    assert torch.allclose(off[0], got[0]) and not torch.allclose(off[1], got[1], atol=1e-3)


def test_the_flags_weights_train(hf_config):
    """Gradients reach every fc_norm weight and (through the fed-back state) the final norm's
    use beyond the head; a few AdamW steps lower the teacher-forced loss."""
    d = _drafter(hf_config, vd=256, **FLAGS).train()
    ids, aux = _inputs(d, T=10)
    target = torch.randint(0, 256, ids.shape)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)

    def loss_fn():
        return sum(torch.nn.functional.cross_entropy(x.flatten(0, 1), target.flatten()) for x in d.unroll(ids, aux, 3))

    first = loss_fn()
    first.backward()
    assert all(n.weight.grad is not None and n.weight.grad.abs().sum() > 0 for n in d.fc_norm)
    opt.step()
    for _ in range(4):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert loss.item() < first.item()


# ---------------------------------------------------------------- the runtime computes the same function
@pytest.fixture(scope="module")
def tiny(hf_config):
    from inference.runtime.model import RuntimeModel
    from models.zoo import resolve_target

    path = resolve_target(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)]
    return hf, RuntimeModel.from_pretrained(path), _runtime_drafter(hf, **FLAGS), prompts


def _runtime_drafter(hf, **flags):
    """Embedding and head from the target, the layer's matrices large enough that the fed state
    decides the chain (with small ones every step repeats the first draft, flags or not)."""
    d = _drafter(hf.config, **flags)
    d.init_from_target(hf, d.d2t.clone(), d.t2d.clone())
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2 and name.startswith(("fc", "layers")):
                p.normal_(0, 0.15)
    return d


def _unrolled_chain(d, target, ctx, k):
    """Training's greedy chain continuing ctx (its last token the one a begin is given)."""
    ids = torch.tensor([ctx])
    with torch.no_grad():
        steps = d.unroll(ids, target(ids).aux, k, greedy=True)
    return [int(d.draft_ids()[s[0, len(ctx) - 2].argmax()]) for s in steps]


def test_runtime_chain_drafts_are_the_unrolls_and_lossless(tiny):
    from inference.proposers import Eagle3Proposer
    from inference.runtime.engine import cache_size, generate
    from models.target import Target

    hf, rt, d, prompts = tiny
    k, calls, n = 4, [], cache_size(prompts, 16, 4)

    class Recording:  # the host loop, through the proposer's own draft: (context, drafts) of every step
        def __init__(self, inner):
            self.inner, self.k, self.aux_layers = inner, inner.k, inner.aux_layers

        def begin(self, *a):
            self.inner.begin(*a)

        def propose(self, tokens):
            drafts = self.inner.propose(tokens)
            calls.append(([list(t) for t in tokens], drafts))
            return drafts

        def accepted(self, *a):
            self.inner.accepted(*a)

    plain = generate(rt, prompts, 16)[0]
    assert generate(rt, prompts, 16, proposer=Recording(Eagle3Proposer(d, k, batch=3, max_len=n)))[0] == plain
    out, stats = generate(rt, prompts, 16, proposer=Eagle3Proposer(d, k, batch=3, max_len=n))
    assert stats.device_loop and out == plain  # greedy speculative decoding is plain greedy (float32)
    target, checked = Target(hf, d.aux_layer_ids), 0
    for contexts, drafts in calls:
        for ctx, got in zip(contexts, drafts):
            assert got == _unrolled_chain(d, target, ctx, k), len(ctx)
            checked += 1
    assert checked >= 10
    assert len({tuple(d) for _, drafts in calls for d in drafts}) > 5  # chains that differ: a fed state that counts


def test_runtime_tree_of_one_branch_is_the_chain_and_trees_are_lossless(tiny):
    from inference.proposers import Eagle3Proposer
    from inference.runtime.engine import cache_size, generate
    from inference.tree.loop import EagleTreeProposer
    from models.target import Target

    hf, rt, d, prompts = tiny
    target = Target(hf, d.aux_layer_ids)
    # a tree that keeps one node per depth drafts the greedy chain, fed as the chain is; and a
    # drafter with both fc norms (vLLM computes input_norm, then fc_norm) leaves the fused norm kernel
    both = _runtime_drafter(hf, norm_before_fc=True, fc_norm=True)
    for drafter in (d, both):
        chain = Eagle3Proposer(drafter, 4, 1, 64)
        tree = EagleTreeProposer(drafter, depth=4, top_k=1, total_tokens=4, batch=1, max_len=64)
        with torch.no_grad():
            aux = target(torch.tensor([prompts[1]])).aux
            for p in (chain, tree):
                p.begin([prompts[1]], aux, [17])
            drafted = chain.draft()[0].tolist()
            assert drafted == _unrolled_chain(drafter, target, prompts[1] + [17], 4)
            assert tree.draft_tree().tokens[0].tolist() == drafted
    n = cache_size(prompts, 16, 16)
    tree = EagleTreeProposer(d, depth=3, top_k=3, total_tokens=8, batch=3, max_len=n, target_config=rt.config)
    assert generate(rt, prompts, 16, proposer=tree, max_len=n)[0] == generate(rt, prompts, 16)[0]


# ---------------------------------------------------------------- the exports, as the servers read them
def vllm_eagle3_norm_params(view: dict, n_aux: int) -> dict:
    """The norm parameters vLLM 0.33's Eagle3LlamaForCausalLM builds from the HF config
    (llama_eagle3.py:184-187 and 223-240): `model.input_norm` over n*Ht when norm_before_fc,
    `model.fc_norm.{i}` of Ht each when fc_norm (read at the top level, not from eagle_config),
    plus the final `model.norm`."""
    Ht = view.get("target_hidden_size", view["hidden_size"])
    params = {"model.norm.weight": (view["hidden_size"],)}
    if view.get("norm_before_fc"):
        params["model.input_norm.weight"] = (n_aux * Ht,)
    if view.get("fc_norm"):
        params.update({f"model.fc_norm.{i}.weight": (Ht,) for i in range(n_aux)})
    return params


def vllm_loaded_names(tensors: dict) -> dict:
    """load_weights (llama_eagle3.py:425-446): t2d dropped, d2t renamed, every other name but
    lm_head's prefixed `model.`; an unknown name fails AutoWeightsLoader."""
    out = {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else \
            name if "lm_head" in name else "model." + name
        out[name] = tuple(t.shape)
    return out


@pytest.mark.parametrize("flags", [FLAGS, {"fc_norm": True}, {"norm_output": True}], ids=["both", "fc_norm", "norm_output"])
def test_speculators_export_is_what_vllm_033_reads(hf_config, tmp_path, flags):
    from export.speculators import export_speculators
    from tests.test_serving_contracts import vllm_speculators_view

    d = _drafter(hf_config, **flags)
    export_speculators(d, tmp_path / "v", target_name=TARGET, target_arch=["LlamaForCausalLM"], k=3, dtype=torch.float32)
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    view = vllm_speculators_view(config) | {"target_hidden_size": config["target_hidden_size"]}
    # speculators/algos.py:37-38: top-level keys, absent = false
    assert view["fc_norm"] is flags.get("fc_norm", False) and view["norm_output"] is flags.get("norm_output", False)
    n_aux = config["transformer_layer_config"]["num_aux_hidden_states"]
    loaded = vllm_loaded_names(load_file(str(tmp_path / "v" / "model.safetensors")))
    norms = {n: s for n, s in loaded.items() if "norm" in n and ".layers." not in n}
    assert norms == vllm_eagle3_norm_params(view, n_aux)  # each built norm loaded, nothing unknown


@pytest.mark.parametrize("flags", [FLAGS, {"fc_norm": True}, {"norm_output": True}], ids=["both", "fc_norm", "norm_output"])
def test_sglang_export_is_what_sglang_0523_reads(hf_config, tmp_path, flags):
    """SGLang 0.5.23 llama_eagle3.py: fc_norm (or use_aux_norm) and norm_output read from the
    config's top level (:185-187, 207), fc_norm.{i} built per aux state (:188-196); weights
    renamed midlayer -> layers.0 and prefixed model. unless already a parameter (:338-372),
    unknown ones skipped silently (so a wrong name leaves a norm at its init: compared here)."""
    from export.sglang import export_sglang

    d = _drafter(hf_config, **flags)
    export_sglang(d, tmp_path / "s", target_name=TARGET, dtype=torch.float32)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert bool(config.get("fc_norm") or config.get("use_aux_norm", False)) is flags.get("fc_norm", False)
    assert bool(config.get("norm_output", False)) is flags.get("norm_output", False)
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    H = config["hidden_size"]
    built = {"model.norm.weight": (H,)}
    if config.get("fc_norm") or config.get("use_aux_norm"):
        built.update({f"model.fc_norm.{i}.weight": (H,) for i in range(n_aux)})
    loaded = {}
    for name, t in load_file(str(tmp_path / "s" / "model.safetensors")).items():
        name = name.replace("midlayer", "layers.0")
        for legacy, new in (("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"), ("aux_norm_high", "fc_norm.2")):
            name = name.replace(legacy, new)
        loaded[name if name.startswith("lm_head") else "model." + name] = tuple(t.shape)
    assert {n: s for n, s in loaded.items() if "norm" in n and ".layers." not in n} == built


@pytest.mark.parametrize("layout", ["speculators", "sglang"])
def test_the_drafter_rebuilt_from_the_served_config_computes_the_trained_one(hf_config, tmp_path, layout):
    """What export.check's levels (b) and (c) hold: config.json alone (a server's view) builds
    the trained drafter, and a config.json without the flags is named and drafts otherwise."""
    from export.check import served_problems
    from export.formats import layout_module, write_export
    from export.load import load_export

    d = _drafter(hf_config, **FLAGS)
    folder = write_export(d, layout, tmp_path / layout, method="eagle3", target_name=TARGET, hf_config=hf_config,
                          target_model=None, joint=False, k=3, provenance={}, dtype=torch.float32)
    served = load_export(folder, served=True)
    ids, aux = _inputs(d)
    with torch.no_grad():
        want, got = d.unroll(ids, aux, 3, greedy=True), served.unroll(ids, aux, 3, greedy=True)
    assert max((a - b).abs().max().item() for a, b in zip(want, got)) <= 1e-5
    config = json.loads((folder / "config.json").read_text())
    meta = json.loads((folder / "draftsmith.json").read_text())
    assert served_problems(folder, layout_module("eagle3", layout), meta, config) == []
    for flag in FLAGS:
        edited = {k: v for k, v in config.items() if k != flag}  # a reader's default: false
        (folder / "config.json").write_text(json.dumps(edited))
        problems = served_problems(folder, layout_module("eagle3", layout), meta, edited)
        assert any(p.startswith(f"{flag}: config.json") for p in problems), problems
    (folder / "config.json").write_text(json.dumps(config))


def test_a_trained_eagle31_run_exports_what_export_check_passes(tmp_path):
    """configs/eagle31.yaml, two steps on the tiny target: the checkpoint records the flags,
    the run's export (speculators) carries them and passes every level of export.check
    (parity with the checkpoint included); so does the SGLang export of the same checkpoint."""
    from export.__main__ import main as export_main
    from export.check import run_checks
    from tests.conftest import make_conversations, tiny_overrides
    from train.config import load_config
    from train.run import run

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in make_conversations(40)))
    overrides = tiny_overrides(str(chat), tmp_path / "run", **{"trainer.max_steps": 2, "trainer.precision": "32-true",
                                                                "eval.every_n_steps": 100})
    run(load_config("configs/eagle31.yaml", overrides))
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True and config["norm_before_fc"] is False
    checks = run_checks(export)
    assert all(c.ok for c in checks), [c.line() for c in checks]
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--format", "sglang", "--out", str(tmp_path / "sglang")]) == 0
    checks = run_checks(tmp_path / "sglang")
    assert all(c.ok for c in checks), [c.line() for c in checks]
