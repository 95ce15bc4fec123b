import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith_kernels.settings import KernelSettings, applied
from inference.runtime.model import RuntimeModel
from tests.conftest import kernel_device


def _check_against_hf(path, prompts_ids, atol):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(path, dtype=torch.float32)
    for ids in prompts_ids:
        ids = torch.as_tensor(ids)[None]
        with torch.no_grad():
            ref = hf(ids).logits
            cache = rt.new_cache(1, ids.shape[1] + 8)
            # prefill all but the last 3 tokens, then feed them one by one: cache reuse
            n = ids.shape[1] - 3
            pos = torch.arange(ids.shape[1])[None]
            first, _ = rt(ids[:, :n], pos[:, :n], cache)
            rest = [rt(ids[:, i : i + 1], pos[:, i : i + 1], cache)[0] for i in range(n, ids.shape[1])]
        got = torch.cat([first, *rest], 1)
        assert (got - ref).abs().max().item() <= atol


def test_runtime_logits_match_transformers_tiny(tiny_target):
    torch.manual_seed(0)
    _check_against_hf(tiny_target, [torch.randint(0, 40000, (n,)) for n in (5, 17, 40)], atol=1e-4)


@pytest.mark.slow
def test_runtime_logits_match_transformers_zoo_target(tokenizer):
    from models.zoo import resolve_target

    path = resolve_target("smollm2-135m-instruct")
    prompts = ["What is the capital of France?", "Write a haiku about the sea.\nMake it sad."]
    from data.chat import encode_prompt

    ids = [encode_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    _check_against_hf(path, ids, atol=1e-4)


def test_ragged_batch_equals_rows_alone(tiny_target):
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(1)
    a, b = torch.randint(0, 40000, (9,)), torch.randint(0, 40000, (4,))
    with torch.no_grad():
        solo = []
        for row in (a, b):
            cache = rt.new_cache(1, 16)
            solo.append(rt(row[None], torch.arange(len(row))[None], cache)[0][0])
        # batched: b right-padded to 9 tokens; its padding sits at positions 4..8
        cache = rt.new_cache(2, 16)
        ids = torch.stack([a, torch.cat([b, torch.zeros(5, dtype=torch.long)])])
        pos = torch.arange(9).expand(2, 9)
        both = rt(ids, pos, cache)[0]
    torch.testing.assert_close(both[0], solo[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1, :4], solo[1], rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_is_named():
    from types import SimpleNamespace

    from inference.runtime.model import RuntimeConfig

    with pytest.raises(ValueError, match="'gpt2' has no runtime implementation"):
        RuntimeConfig.from_hf(SimpleNamespace(model_type="gpt2"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_step_equals_eager(tiny_target):
    from inference.runtime.engine import generate

    rt = RuntimeModel.from_pretrained(tiny_target, dtype=torch.float32, device="cuda")
    torch.manual_seed(0)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (5, 12)]
    eager, _ = generate(rt, prompts, 16, cuda_graphs=False)
    graphed, _ = generate(rt, prompts, 16, cuda_graphs=True)
    assert graphed == eager


def test_forward_through_the_kernels_equals_the_torch_path(tiny_target):
    """The whole model with every runtime kernel (Triton interpreter on CPU) gives the logits
    and cache of the torch references, for a ragged prefill and a decode step."""
    device = kernel_device()
    rt = RuntimeModel.from_pretrained(tiny_target, device=device)
    torch.manual_seed(2)
    ids = torch.randint(0, 40000, (2, 7), device=device)
    results = []
    for mode in ("off", "force"):
        cache = rt.new_cache(2, 16)
        with torch.no_grad(), applied(KernelSettings(mode=mode)):
            a, aux_a = rt(ids, torch.arange(7, device=device).expand(2, 7), cache, (0,), causal_prefill=True)
            b, aux_b = rt(ids[:, :2], torch.tensor([[7, 8], [5, 6]], device=device), cache, (1,))
        results.append((a, aux_a, b, aux_b, cache.k.clone(), cache.v.clone()))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_tree_verify_forward_through_the_kernels_equals_the_torch_path_and_chains(tiny_target):
    """A tree verify step (`tree_mask=`: root at slot base, node i at base + 1 + i) over a ragged
    cache: through the kernels (RoPE at the tree's slots, tree attention reading the block from
    the cache) it gives the torch path's logits, aux features and cache; and each root-to-leaf
    path's logits are those of a chain verify step feeding that path alone."""
    from inference.tree.ops import ancestor_mask

    device = kernel_device()
    rt = RuntimeModel.from_pretrained(tiny_target, device=device)
    torch.manual_seed(4)
    prompt = torch.randint(0, 40000, (2, 7), device=device)
    base = torch.tensor([6, 3], device=device)  # row 1's slots 4..6 hold stale entries, never seen
    parents = torch.tensor([[-1, -1, 0, 0, 2]], device=device).expand(2, -1)  # paths 0-2-4, 0-3, 1
    depths = torch.tensor([[1, 1, 2, 2, 3]], device=device)
    fed = torch.randint(0, 40000, (2, 6), device=device)  # the root, then the 5 nodes
    positions = torch.cat([base[:, None], base[:, None] + depths], 1)
    with torch.no_grad():
        prefilled = rt.new_cache(2, 16)
        rt(prompt, torch.arange(7, device=device).expand(2, 7), prefilled, causal_prefill=True)
    results = []
    for mode in ("off", "force"):
        cache = rt.new_cache(2, 16)
        cache.k.copy_(prefilled.k)
        cache.v.copy_(prefilled.v)
        with torch.no_grad(), applied(KernelSettings(mode=mode)):
            logits, aux = rt(fed, positions, cache, (0, 1), tree_mask=ancestor_mask(parents))
        results.append((logits, aux, cache.k.clone(), cache.v.clone()))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for path in ([0, 2, 4], [0, 3], [1]):
        index = torch.tensor([0] + [1 + i for i in path], device=device)  # the root, then the path's nodes
        cache = rt.new_cache(2, 16)
        cache.k.copy_(prefilled.k)
        cache.v.copy_(prefilled.v)
        with torch.no_grad(), applied(KernelSettings(mode="off")):
            chain, _ = rt(fed[:, index], base[:, None] + torch.arange(len(index), device=device), cache)
        torch.testing.assert_close(results[1][0][:, index], chain, rtol=1e-5, atol=1e-5)


def test_causal_prefill_equals_the_masked_cache_path(tiny_target):
    rt = RuntimeModel.from_pretrained(tiny_target)
    ids = torch.randint(0, 40000, (3, 9))
    pos = torch.arange(9).expand(3, 9)
    with torch.no_grad():
        fast = rt(ids, pos, rt.new_cache(3, 12), causal_prefill=True)[0]
        masked = rt(ids, pos, rt.new_cache(3, 12))[0]
    torch.testing.assert_close(fast, masked, rtol=1e-5, atol=1e-5)


def test_loading_names_a_missing_or_misshapen_tensor(tiny_target, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    for name, change in (("model.layers.1.self_attn.k_proj.weight", "drop"), ("model.layers.0.mlp.up_proj.weight", "shape")):
        folder = tmp_path / change
        shutil.copytree(tiny_target, folder)
        (weights,) = folder.glob("*.safetensors")
        state = load_file(str(weights))
        if change == "drop":
            del state[name]
        else:
            state[name] = state[name][:-1].clone()
        save_file(state, str(weights))
        with pytest.raises((KeyError, ValueError), match=name.removeprefix("model.").replace(".", r"\.")):
            RuntimeModel.from_pretrained(folder)


def test_unsupported_architecture_runs_on_the_transformers_slow_path(tmp_path, caplog):
    """A GPT-2 target: logged once, greedy output equal to transformers' generate, and
    speculative decoding on top of it stays lossless."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    from inference.runtime.engine import generate
    from inference.runtime.fallback import TransformersFallback, load_runtime
    from inference.proposers import NgramProposer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="draftsmith.runtime"):
        model = load_runtime(tmp_path)
        load_runtime(tmp_path)
    assert isinstance(model, TransformersFallback)
    assert sum("slow path" in r.message for r in caplog.records) == 1
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    prompts = [[1, 2, 3, 1, 2], [7, 8]]
    plain, _ = generate(model, prompts, 10)
    for p, out in zip(prompts, plain):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert out == ref
    spec, stats = generate(model, prompts, 10, proposer=NgramProposer(3))
    assert spec == plain and sum(stats.histogram) > 0


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_qwen3_with_per_head_norms_matches_transformers(tmp_path, kernels):
    """Qwen3 normalises each query and key head before RoPE (`head_norm`, in place): a tiny random
    Qwen3 matches transformers' logits, through the torch path and through the kernels."""
    import os

    from transformers import Qwen3Config, Qwen3ForCausalLM

    if kernels == "force" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so that a missing or misplaced weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    with applied(KernelSettings(mode=kernels)):
        _check_against_hf(tmp_path, [torch.randint(0, 300, (n,)) for n in (6, 11)], atol=1e-4)


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_mistral_with_a_sliding_window_matches_transformers(tmp_path, kernels):
    """Mistral windows every layer (config.sliding_window, no layer_types): with a window shorter
    than the prompts, a tiny random Mistral matches transformers' logits through the masked cache
    path and the windowed decode kernel."""
    import os

    from transformers import MistralConfig, MistralForCausalLM

    from draftsmith_kernels.settings import KernelSettings, applied

    if kernels == "force" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=128, sliding_window=5, tie_word_embeddings=False)
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    rt = RuntimeModel.from_pretrained(tmp_path)
    assert rt.config.sliding_window == 5 and rt.config.local_layers == (0, 1)
    with applied(KernelSettings(mode=kernels)):
        _check_against_hf(tmp_path, [torch.randint(0, 300, (n,)) for n in (6, 13)], atol=1e-4)
