import pytest
import torch

from models.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from models.ttt_attention import ttt_attention, ttt_attention_reference, ttt_mask
from train.losses import soft_kl, ttt_slices


def tiny_drafter(seed=0, V=300, Vd=64, H=32):
    torch.manual_seed(seed)
    cfg = Eagle3Config(vocab_size=V, draft_vocab_size=Vd, hidden_size=H, target_hidden_size=H, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, aux_layer_ids=[0, 1, 2],
                       target_num_layers=4, rope_theta=10000.0)
    d = Eagle3Drafter(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.sort(torch.randperm(V)[:Vd]).values
    d.d2t.copy_(ids - torch.arange(Vd))
    d.t2d.zero_()[ids] = True
    return d


def test_default_aux_layers():
    assert default_aux_layer_ids(30) == [1, 14, 26]


def test_config_rejects_layer_beyond_depth():
    with pytest.raises(ValueError, match="aux layer id 4 is out of range"):
        Eagle3Config(vocab_size=10, draft_vocab_size=5, hidden_size=8, target_hidden_size=8, intermediate_size=8,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, aux_layer_ids=[0, 4], target_num_layers=4)


def test_ttt_mask_sees_causal_context_and_own_chain_only():
    T = 6
    for steps in range(1, 5):
        m = ttt_mask(T, steps, "cpu")
        assert m.shape == (T, steps * T)
        for t in range(T):
            for j in range(steps):
                for u in range(T):
                    expect = (u <= t) if j == 0 else (u == t)
                    assert bool(m[t, j * T + u]) == expect


def test_shapes():
    d = tiny_drafter()
    ids = torch.randint(0, 300, (2, 11))
    out = d.unroll(ids, torch.randn(2, 11, 96), steps=4)
    assert len(out) == 4 and all(o.shape == (2, 11, 64) for o in out)


@pytest.mark.parametrize("greedy", [False, True])
def test_no_step_sees_a_future_position(greedy):
    """Step s at index t may read tokens <= t+1+s (teacher) or <= t+1 (greedy) and features <= t."""
    d = tiny_drafter().eval()
    T, steps = 12, 4
    ids = torch.randint(0, 300, (1, T))
    aux = torch.randn(1, T, 96)
    with torch.no_grad():
        base = d.unroll(ids, aux, steps, greedy=greedy)
    for t in range(T - 1):
        for s in range(steps):
            last_token = t + 1 + (0 if greedy else s)
            if last_token >= T - 1:
                continue
            ids2, aux2 = ids.clone(), aux.clone()
            ids2[0, last_token + 1 :] = torch.randint(0, 300, (T - last_token - 1,))
            aux2[0, t + 1 :] = torch.randn(T - t - 1, 96)
            with torch.no_grad():
                other = d.unroll(ids2, aux2, steps, greedy=greedy)
            torch.testing.assert_close(other[s][0, t], base[s][0, t], rtol=1e-5, atol=1e-5)


def test_ttt_inputs_are_shifted_tokens_and_fed_back_hidden(monkeypatch):
    """Teacher forcing feeds x_{t+1+s} at step s, with positions t+s."""
    d = tiny_drafter()
    seen = []
    real_step = d.step
    monkeypatch.setattr(d, "step", lambda tokens, hidden, positions, attend: (seen.append((tokens.clone(), positions.clone())), real_step(tokens, hidden, positions, attend))[1])
    ids = torch.arange(10)[None] + 100
    d.unroll(ids, torch.randn(1, 10, 96), steps=3)
    for s, (tokens, positions) in enumerate(seen):
        n = 10 - 1 - s
        assert torch.equal(tokens[0, :n], ids[0, 1 + s : 1 + s + n])
        assert torch.equal(positions[0], torch.arange(10) + s)


def test_loss_falls_when_overfitting_one_batch():
    d = tiny_drafter(seed=1)
    torch.manual_seed(3)
    B, T, steps = 2, 16, 3
    ids = torch.randint(0, 300, (B, T))
    aux = torch.randn(B, T, 96)
    teacher = torch.softmax(torch.randn(B, T, 64) * 3, -1)
    mask = torch.ones(B, T)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)

    def loss_fn():
        total = 0
        for s, logits in enumerate(d.unroll(ids, aux, steps)):
            a, b, c = ttt_slices(T, s)
            total = total + 0.8**s * soft_kl(logits[:, a], teacher[:, b], mask[:, c])
        return total

    first = loss_fn().item()
    for _ in range(200):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first, (first, loss.item())


def test_soft_kl_matches_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    p = torch.softmax(torch.randn(3, 5, 7), -1)
    mask = torch.tensor([[1, 0, 1, 1, 0]] * 3)
    q = torch.softmax(logits, -1)
    kl = (p * (p.log() - q.log())).sum(-1)
    expect = (kl * mask).sum() / mask.sum()
    torch.testing.assert_close(soft_kl(logits, p, mask), expect)
    assert soft_kl(torch.log(p), p, mask).abs() < 1e-6


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_ttt_attention_matches_dense_mask_reference_with_gradients(steps, T):
    torch.manual_seed(steps * 100 + T)
    B, h, d = 2, 3, 16
    q = torch.randn(B, h, T, d, requires_grad=True)
    ks = [torch.randn(B, h, T, d, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, h, T, d, requires_grad=True) for _ in range(steps)]
    out, ref = ttt_attention(q, ks, vs), ttt_attention_reference(q, ks, vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [q, *ks, *vs], g), torch.autograd.grad(ref, [q, *ks, *vs], g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_drafters_keep_rope_frequencies_float32_when_cast():
    """A drafter cast to bfloat16 for serving keeps the float32 RoPE frequencies it trained with
    (rounded, they turn keys 300 positions apart by up to about 0.3 rad)."""
    from transformers import LlamaConfig

    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle1 import Eagle1Config, Eagle1Drafter
    from models.layers import rope_inv_freq
    from models.mtp import MTPConfig, MTPDrafter

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, rope_theta=100000.0)
    drafters = [Eagle3Drafter(Eagle3Config.from_target(cfg, 128)), Eagle1Drafter(Eagle1Config.from_target(cfg, 128)),
                MTPDrafter(MTPConfig.from_target(cfg, 128, num_modules=2)),
                DFlashDrafter(DFlashConfig.from_target(cfg, 300, mask_token_id=0, num_layers=1, block_size=4))]
    exact = rope_inv_freq(16, 100000.0)
    assert not torch.equal(exact.to(torch.bfloat16).float(), exact)  # a cast would round them
    for d in drafters:
        d = d.to(torch.bfloat16)
        assert d.inv_freq.dtype == torch.float32 and torch.equal(d.inv_freq, exact), type(d).__name__
        assert next(d.parameters()).dtype == torch.bfloat16  # everything else is cast


def test_ttt_attention_takes_mixed_dtypes_as_cpu_autocast_leaves_them():
    # a GPU-trained export's promise made on a CPU (bf16-mixed): q float32, keys and values bf16
    torch.manual_seed(0)
    B, h, T, d = 1, 2, 9, 8
    q = torch.randn(B, h, T, d)
    ks = [torch.randn(B, h, T, d).bfloat16() for _ in range(3)]
    vs = [torch.randn(B, h, T, d).bfloat16() for _ in range(3)]
    out = ttt_attention(q, ks, vs)
    ref = ttt_attention_reference(q, [k.float() for k in ks], [v.float() for v in vs])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
