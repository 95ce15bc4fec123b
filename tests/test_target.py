import torch
from transformers import AutoModelForCausalLM

from models.target import Target
from tests.conftest import device_reads


def _target(path, layers):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Target(model, layers)


def test_layer_ids_match_output_hidden_states(tiny_target):
    target = _target(tiny_target, [0, 1])
    L = target.num_layers
    ids = torch.randint(0, 1000, (2, 17))
    with torch.no_grad():
        out = target(ids)
        ref = target.model(ids, output_hidden_states=True).hidden_states
    H = target.config.hidden_size
    # layer id i is hidden_states[i + 1]; transformers norms the last one, we return it pre-norm
    for slot, i in enumerate([0, 1]):
        got = out.aux[..., slot * H : (slot + 1) * H]
        expect = ref[i + 1] if i < L - 1 else None
        if expect is not None:
            torch.testing.assert_close(got, expect, rtol=0, atol=0)
        else:
            torch.testing.assert_close(target.decoder.norm(got), ref[L], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.last_hidden, ref[L], rtol=0, atol=0)


def test_layer_id_out_of_range_is_an_error(tiny_target):
    import pytest

    with pytest.raises(ValueError, match="layer id 2 is out of range"):
        _target(tiny_target, [0, 2])


def test_head_outputs_are_chunked_restricted_softmax_and_full_argmax(tiny_target):
    target = _target(tiny_target, [0])
    h = torch.randn(2, 9, target.config.hidden_size)
    draft_ids = torch.tensor([3, 17, 100, 2000, 40000])
    probs, greedy = target.head_outputs(h, draft_ids, chunk_rows=4)
    logits = h @ target.head_weight.T
    torch.testing.assert_close(probs, torch.softmax(logits[..., draft_ids], -1))
    assert torch.equal(greedy, logits.argmax(-1))


def test_greedy_after_chains_equals_one_forward_per_chain(tiny_target):
    target = _target(tiny_target, [0])
    torch.manual_seed(0)
    T, c = 20, 3
    ids = torch.randint(0, 5000, (T,))
    anchors = torch.tensor([0, 5, 11, 17])
    chains = torch.randint(0, 5000, (len(anchors), c))
    got = target.greedy_after_chains(ids, anchors, chains)
    for i, a in enumerate(anchors.tolist()):
        seq = torch.cat([ids[: a + 2], chains[i]])[None]
        with torch.no_grad():
            logits = target.model(seq).logits[0]
        assert torch.equal(got[i], logits[a + 2 :].argmax(-1)), f"anchor {a}"


def test_chain_steps_equal_the_whole_forward_and_restart_per_window(tiny_target):
    """The incremental form (the text's keys and values once, a token per chain per step)
    computes what one forward over the text with all chains grafted on computes; `start`
    forgets the previous window's chains."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    target = Target(model, [0])
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (40,))
    steps = target.chain_steps(ids)
    for anchors, c in ((torch.tensor([3, 10, 17, 30]), 3), (torch.tensor([0, 5, 36]), 2)):
        chains = torch.randint(0, model.config.vocab_size, (anchors.numel(), c))
        want = target.hidden_after_chains(ids, anchors, chains)
        steps.start(anchors)
        got = torch.stack([steps.step(chains[:, i]) for i in range(c)], 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert steps.cache.get_seq_length() == ids.numel() + anchors.numel() * c


def test_the_training_pass_reads_nothing_back_and_equals_transformers_own(tiny_target):
    target = _target(tiny_target, [0, 1])
    ids = torch.randint(0, 1000, (3, 19))
    with torch.no_grad():
        out, reads = device_reads(lambda: target(ids))
        # transformers' own path (its mask preparation reads the positions back: a sync a step)
        ref, ref_reads = device_reads(lambda: target(ids, position_ids=torch.arange(19).expand(3, 19)))
    assert reads == [] and ref_reads != []
    assert torch.equal(out.aux, ref.aux) and torch.equal(out.last_hidden, ref.last_hidden)
    assert target.config._attn_implementation == "sdpa"  # switched for the call only


def test_a_sliding_window_target_keeps_transformers_attention(tiny_target):
    from models.target import plain_causal

    target = _target(tiny_target, [0])
    assert plain_causal(target.config)
    target.config.sliding_window = 8
    assert not plain_causal(target.config)
    target.config.sliding_window = None
    target.config.layer_types = ["full_attention", "sliding_attention"]
    assert not plain_causal(target.config)
    target.config.layer_types = None
    target.config.model_type = "gemma2"  # soft-capped attention: not a listed family
    assert not plain_causal(target.config)


def test_the_causal_attention_refuses_what_it_does_not_compute():
    import pytest

    from models.target import causal_attention

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    out, _ = causal_attention(None, q, k, k, None, scaling=0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2))
    with pytest.raises(ValueError, match="softcap"):
        causal_attention(None, q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match="attention_mask"):
        causal_attention(None, q, k, k, torch.ones(1, 1, 5, 5, dtype=torch.bool))
