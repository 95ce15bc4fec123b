"""Gemma-3 on the runtime's fast path: logits equal to transformers' (float32) for a tiny random
gemma3_text whose sliding window is shorter than the test's sequences (so local layers really
see less than global ones), in prefill, decode and verify steps over the static cache, through
the torch path and the kernels; the windowed decode-attention kernel against its reference; and
greedy speculative decoding equal to plain greedy."""
import os

import pytest
import torch

from draftsmith_kernels.settings import KernelSettings, applied
from inference.runtime.model import RuntimeModel
from tests.conftest import kernel_device

WINDOW = 4


def _needs_triton(kernels: str):
    if kernels == "force" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """4 layers (local, global, local, global), GQA, a query scale that is not head_dim's, final
    logit soft-capping, norm weights away from 0 (Gemma's norms multiply by 1 + w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                           query_pre_attn_scalar=24, final_logit_softcapping=5.0, rope_local_base_freq=100.0,
                           rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return path


def test_config_carries_gemma3s_layers(tiny_gemma3):
    from transformers import AutoConfig

    from inference.runtime.model import RuntimeConfig

    cfg = RuntimeConfig.from_hf(AutoConfig.from_pretrained(tiny_gemma3))
    assert cfg.gemma and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.sliding_window == WINDOW and cfg.local_layers == (0, 2)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (10000.0, 100.0)
    assert cfg.query_scale == pytest.approx(24 ** -0.5) and cfg.final_logit_softcapping == 5.0


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_gemma3_logits_match_transformers_in_prefill_decode_and_verify(tiny_gemma3, kernels):
    """A ragged batch: causal prefill (longer than the window), then one-token decode steps and a
    three-token verify step at each row's own positions; every logit within 1e-4 of transformers'
    forward over the whole sequence."""
    from transformers import AutoModelForCausalLM

    _needs_triton(kernels)
    device = kernel_device() if kernels == "force" else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_gemma3, dtype=torch.float32, device=device)
    torch.manual_seed(1)
    lengths = (13, 9)  # prompt lengths: 13 - 5 then 9 - 5 tokens follow one by one, then 3 at once
    seqs = [torch.randint(3, 300, (n + 5,)) for n in lengths]
    with torch.no_grad():
        refs = [hf(s[None]).logits[0] for s in seqs]
        cache = rt.new_cache(2, 40)
        n0 = min(lengths)
        ids = torch.stack([s[:n0] for s in seqs]).to(device)
        with applied(KernelSettings(mode=kernels)):
            got = [[t] for t in rt(ids, torch.arange(n0, device=device).expand(2, n0), cache, causal_prefill=True)[0]]
            # row 0 catches up through a masked multi-token step (row 1 fed padding beyond its length)
            extra = lengths[0] - n0
            ids = torch.stack([seqs[0][n0:lengths[0]], torch.zeros(extra, dtype=torch.long)]).to(device)
            pos = torch.stack([torch.arange(n0, lengths[0]), torch.arange(n0, lengths[0]) + 20]).to(device)
            got[0].append(rt(ids, pos, cache)[0][0])
            for step in range(2):  # decode steps
                ids = torch.tensor([[seqs[b][lengths[b] + step]] for b in range(2)], device=device)
                pos = torch.tensor([[lengths[b] + step] for b in range(2)], device=device)
                out = rt(ids, pos, cache)[0]
                for b in range(2):
                    got[b].append(out[b])
            ids = torch.stack([seqs[b][lengths[b] + 2: lengths[b] + 5] for b in range(2)]).to(device)
            pos = torch.stack([torch.arange(lengths[b] + 2, lengths[b] + 5) for b in range(2)]).to(device)
            out = rt(ids, pos, cache)[0]  # a verify step of 3 tokens
        for b in range(2):
            got[b].append(out[b])
    for b in range(2):
        full = torch.cat(got[b]).cpu()
        assert full.shape == refs[b].shape
        assert (full - refs[b]).abs().max().item() <= 1e-4


def test_the_window_changes_local_layers(tiny_gemma3):
    """The same weights with a window longer than the sequence give other logits: the test above
    exercises the window, not a mask that never binds."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_gemma3 / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_gemma3)
    rt_wide = RuntimeModel.from_pretrained(tiny_gemma3)
    for layer in rt_wide.layers:
        layer.self_attn.window = 10 ** 6 if layer.local else None
    wide_cfg = rt_wide.config
    wide_cfg.sliding_window = 10 ** 6
    ids = torch.randint(3, 300, (1, 16))
    with torch.no_grad():
        ref = hf(ids).logits
        a = rt(ids, torch.arange(16)[None], rt.new_cache(1, 20))[0]
        b = rt_wide(ids, torch.arange(16)[None], rt_wide.new_cache(1, 20))[0]
    assert cfg["sliding_window"] == WINDOW
    assert (a - ref).abs().max() <= 1e-4 and (b - ref).abs().max() > 1e-3


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_tree_verify_on_gemma3_equals_its_chains(tiny_gemma3, kernels):
    """A tree verify step (windowed layers on the torch tree path, under tree_window_bias; global
    layers through the tree kernel with kernels forced): each root-to-leaf path's logits are
    those of a chain step feeding that path alone."""
    from inference.tree.ops import ancestor_mask

    _needs_triton(kernels)
    device = kernel_device() if kernels == "force" else "cpu"
    rt = RuntimeModel.from_pretrained(tiny_gemma3, device=device)
    torch.manual_seed(4)
    prompt = torch.randint(3, 300, (2, 9), device=device)
    base = torch.tensor([8, 5], device=device)
    parents = torch.tensor([[-1, -1, 0, 0, 2, 4]], device=device).expand(2, -1)  # paths 0-2-4-5, 0-3, 1
    depths = torch.tensor([[1, 1, 2, 2, 3, 4]], device=device)
    fed = torch.randint(3, 300, (2, 7), device=device)
    positions = torch.cat([base[:, None], base[:, None] + depths], 1)
    with torch.no_grad(), applied(KernelSettings(mode=kernels)):
        prefilled = rt.new_cache(2, 20)
        rt(prompt, torch.arange(9, device=device).expand(2, 9), prefilled, causal_prefill=True)
        cache = rt.new_cache(2, 20)
        cache.k.copy_(prefilled.k)
        cache.v.copy_(prefilled.v)
        tree, _ = rt(fed, positions, cache, tree_mask=ancestor_mask(parents))
        for path in ([0, 2, 4, 5], [0, 3], [1]):
            index = torch.tensor([0] + [1 + i for i in path], device=device)
            cache.k.copy_(prefilled.k)
            cache.v.copy_(prefilled.v)
            chain, _ = rt(fed[:, index], base[:, None] + torch.arange(len(index), device=device), cache)
            torch.testing.assert_close(tree[:, index], chain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 5])
def test_windowed_decode_attention_kernel_matches_its_reference(n):
    """The decode-attention kernel with a window (chunks before it not read) against the torch
    reference, on rows whose positions put the window across chunk borders."""
    from draftsmith_kernels.decode_attention import decode_attention_reference, decode_attention_triton

    _needs_triton("force")
    device = kernel_device()
    torch.manual_seed(3)
    B, nh, nkv, S, d = 3, 4, 2, 200, 16
    q = torch.randn(B, nh, n, d, device=device)
    k_cache, v_cache = torch.randn(B, nkv, S, d, device=device), torch.randn(B, nkv, S, d, device=device)
    last = torch.tensor([150, 40, 7], device=device)
    positions = last[:, None] - n + 1 + torch.arange(n, device=device)
    for window in (3, 37, 100):
        ref = decode_attention_reference(q, k_cache, v_cache, positions, window=window)
        got = decode_attention_triton(q, k_cache, v_cache, positions, window=window)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ref, decode_attention_reference(q, k_cache, v_cache, positions), atol=1e-3)


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_gemma3_greedy_speculative_decoding_equals_plain_greedy(tiny_gemma3, kernels):
    """A ragged batch of 2 whose generations run past the window: n-gram drafts verified by the
    runtime give plain greedy's tokens, through the torch path and through the kernels."""
    from inference.proposers import NgramProposer
    from inference.runtime.engine import generate

    _needs_triton(kernels)
    device = kernel_device() if kernels == "force" else "cpu"
    rt = RuntimeModel.from_pretrained(tiny_gemma3, dtype=torch.float32, device=device)
    rt.kernels = KernelSettings(mode=kernels)
    torch.manual_seed(5)
    motif = torch.randint(3, 300, (4,)).tolist()
    prompts = [motif * 4 + [7], torch.randint(3, 300, (6,)).tolist() + motif * 2]
    plain, _ = generate(rt, prompts, 24)
    spec, stats = generate(rt, prompts, 24, proposer=NgramProposer(3))
    assert spec == plain
    assert sum(stats.histogram) > 0


@pytest.mark.slow
def test_zoo_gemma3_270m_runtime_logits_match_transformers():
    """The zoo's Gemma-3 270M (its window of 512 never binds on a short prompt; the tiny model
    above covers the window): a causal prefill then one-token decode steps, within 1e-4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.zoo import resolve_target

    path = resolve_target("gemma3-270m")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(path)
    n = ids.shape[1] - 3
    with torch.no_grad():
        ref = hf(ids).logits
        cache = rt.new_cache(1, ids.shape[1] + 4)
        got = [rt(ids[:, :n], torch.arange(n)[None], cache, causal_prefill=True)[0]]
        got += [rt(ids[:, i: i + 1], torch.tensor([[i]]), cache)[0] for i in range(n, ids.shape[1])]
    assert (torch.cat(got, 1) - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_plain_template_on_the_gemma3_tokenizer():
    """A base model trained through data.chat_template=plain: the text opens with <bos> (rendered
    text is tokenized without special tokens), the prompt a server renders is a prefix of the
    trained ids, and the answer's first token is in the loss mask."""
    from transformers import AutoTokenizer

    from data.chat import encode_prompt, tokenize_conversation
    from data.templates import apply_template_choice
    from models.zoo import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("gemma3-270m"))
    assert not getattr(tok, "chat_template", None)
    apply_template_choice(tok, "plain", False, "gemma3-270m")
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there!"}]
    row = tokenize_conversation(tok, messages, 64)
    prompt = encode_prompt(tok, messages[:1])
    assert row["input_ids"][0] == tok.bos_token_id == prompt[0]
    assert row["input_ids"][: len(prompt)] == prompt
    answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tok.decode(answer).strip() == "Hi there!"


def test_training_side_chains_on_gemma3_see_only_the_window(tiny_gemma3):
    """The training eval's grafted chains (models/target.py: one forward with a custom mask, and
    its incremental form over a cache) on a target whose window is shorter than the text: each
    chain's greedy tokens are those of a plain forward over its own context, so the sliding
    layers see only the window there too."""
    from transformers import AutoModelForCausalLM

    from models.target import Target

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    target = Target(model, [0, 2])
    torch.manual_seed(6)
    ids = torch.randint(3, 300, (24,))
    anchors = torch.tensor([1, 9, 15, 20])
    chains = torch.randint(3, 300, (anchors.numel(), 3))
    got = target.greedy_after_chains(ids, anchors, chains)
    for i, a in enumerate(anchors.tolist()):
        with torch.no_grad():
            logits = model(torch.cat([ids[: a + 2], chains[i]])[None]).logits[0]
        assert torch.equal(got[i], logits[a + 2:].argmax(-1)), f"anchor {a}"
    want = target.hidden_after_chains(ids, anchors, chains)
    steps = target.chain_steps(ids)
    steps.start(anchors)
    stepped = torch.stack([steps.step(chains[:, i]) for i in range(3)], 1)
    torch.testing.assert_close(stepped, want, rtol=1e-5, atol=1e-5)


def test_teacher_head_applies_final_soft_capping(tiny_gemma3):
    from transformers import AutoModelForCausalLM

    from models.target import Target

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    target = Target(model, [0])
    ids = torch.randint(3, 300, (1, 10))
    with torch.no_grad():
        out = target(ids)
        probs, greedy = target.head_outputs(out.last_hidden, torch.arange(300))
        logits = model(ids).logits  # soft-capped by transformers (cap 5)
    torch.testing.assert_close(probs, torch.softmax(logits, -1), rtol=1e-5, atol=1e-6)
    assert torch.equal(greedy, logits.argmax(-1))


def test_drafters_copy_gemmas_final_norm_as_it_acts(tiny_gemma3):
    """EAGLE-3 and DFlash start their final norm from the target's; Gemma's multiplies by 1 + w,
    so the drafter's (Llama-style) norm must equal the target's on any hidden state."""
    from transformers import AutoModelForCausalLM

    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    V = hf.config.vocab_size
    keep = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    h = torch.randn(3, hf.config.hidden_size)
    for drafter in (Eagle3Drafter(Eagle3Config.from_target(hf.config, V)),
                    DFlashDrafter(DFlashConfig.from_target(hf.config, V, mask_token_id=0))):
        drafter.init_from_target(hf, *keep)
        with torch.no_grad():
            torch.testing.assert_close(drafter.norm(h), hf.model.norm(h), rtol=1e-5, atol=1e-5)


def test_a_drafter_of_gemma3_takes_the_global_layers_rope(tiny_gemma3):
    """Gemma-3's rope_parameters are per layer type: a drafter's layer (over the whole context)
    takes the global layers' base and no scaling, never the nested dict as its scaling (which
    export.check rightly refused as unlike what config.json serves)."""
    from transformers import AutoConfig

    from models.eagle3 import Eagle3Config
    from models.layers import rope_config

    cfg = AutoConfig.from_pretrained(tiny_gemma3)
    assert rope_config(cfg) == (10000.0, None)  # this config's global base; the local one is 100
    drafter_cfg = Eagle3Config.from_target(cfg, cfg.vocab_size)
    assert (drafter_cfg.rope_theta, drafter_cfg.rope_scaling) == (10000.0, None)


def test_serving_renders_prompts_with_the_template_the_drafter_trained_with(tmp_path, tiny_target):
    """A base model's tokenizer has no chat template: validate, bench and generate take the one
    the export records (training_config.data.chat_template), as training did; an export without
    one leaves the tokenizer as it is; a recorded Jinja file that is gone is a DataError naming it."""
    import json

    from transformers import AutoTokenizer

    from data.sources import DataError
    from data.templates import NAMED_TEMPLATES, trained_template

    def export(name, chosen):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "draftsmith.json").write_text(json.dumps({"training_config": {"data": {"chat_template": chosen}}}))
        return folder

    tok = AutoTokenizer.from_pretrained(tiny_target)
    own = tok.chat_template
    trained_template(tok, [export("none", None), tmp_path / "no-export"], "t")
    assert tok.chat_template == own
    tok.chat_template = None
    trained_template(tok, [export("plain", "plain")], "t")
    assert tok.chat_template == NAMED_TEMPLATES["plain"]
    with pytest.raises(DataError, match="gone.jinja"):
        trained_template(tok, [export("gone", str(tmp_path / "gone.jinja"))], "t")
