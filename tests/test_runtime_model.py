import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.model import RuntimeModel


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

    from inference.model import RuntimeConfig

    with pytest.raises(ValueError, match="'gpt2' has no runtime implementation"):
        RuntimeConfig.from_hf(SimpleNamespace(model_type="gpt2"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_step_equals_eager(tiny_target):
    from inference.engine import generate

    rt = RuntimeModel.from_pretrained(tiny_target, dtype=torch.float32, device="cuda")
    torch.manual_seed(0)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (5, 12)]
    eager, _ = generate(rt, prompts, 16, cuda_graphs=False)
    graphed, _ = generate(rt, prompts, 16, cuda_graphs=True)
    assert graphed == eager
