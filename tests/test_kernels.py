"""Every Triton kernel against its torch reference (on CPU through TRITON_INTERPRET=1, set in
conftest), over odd shapes and each dtype: outputs and gradients."""
import os

import pytest
import torch

from draftsmith_kernels.soft_kl import soft_kl_reference, soft_kl_triton

needs_triton_backend = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs CUDA or TRITON_INTERPRET=1")


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows,V", [(1, 7), (33, 1000), (5, 4099)])
def test_soft_kl_kernel_matches_reference(dtype, tol, rows, V):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(rows * V)
    logits = (torch.randn(rows, V, device=device) * 3).to(dtype).requires_grad_()
    teacher = torch.softmax(torch.randn(rows, V, device=device) * 2, -1).to(dtype)
    teacher[0, : V // 2] = 0  # exact zeros in the teacher are legal
    teacher = teacher / teacher.float().sum(-1, keepdim=True).to(dtype)
    mask = (torch.arange(rows, device=device) % 3 != 1)
    ref = soft_kl_reference(logits, teacher, mask)
    out = soft_kl_triton(logits, teacher, mask)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    g = torch.rand((), device=device) + 0.5
    (gr,) = torch.autograd.grad(ref * g, logits)
    (go,) = torch.autograd.grad(out * g, logits)
    assert go.dtype == logits.dtype
    torch.testing.assert_close(go.float(), gr.float(), rtol=tol, atol=tol * 1e-2 if dtype == torch.float32 else tol)


@needs_triton_backend
def test_soft_kl_kernel_on_a_3d_slice_and_an_empty_mask():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(2, 9, 37, device=device)[:, 1:]  # a non-contiguous TTT-style slice
    teacher = torch.softmax(torch.randn(2, 8, 37, device=device), -1)
    mask = torch.zeros(2, 8, dtype=torch.bool, device=device)
    assert soft_kl_triton(logits, teacher, mask).item() == 0.0
    mask[1, 3] = True
    torch.testing.assert_close(soft_kl_triton(logits, teacher, mask), soft_kl_reference(logits, teacher, mask))


@needs_triton_backend
def test_convergence_with_and_without_the_kernel():
    """A tiny drafter overfitting one batch follows the same loss curve with either loss."""
    from tests.test_eagle3 import tiny_drafter
    from train.losses import ttt_slices

    curves = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for loss_fn in (soft_kl_reference, soft_kl_triton):
        d = tiny_drafter(seed=1).to(device)
        torch.manual_seed(3)
        ids, aux = torch.randint(0, 300, (2, 12)).to(device), torch.randn(2, 12, 96).to(device)
        teacher = torch.softmax(torch.randn(2, 12, 64) * 3, -1).to(device)
        mask = torch.ones(2, 12, device=device)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
        curve = []
        for _ in range(25):
            opt.zero_grad()
            loss = 0
            for s, logits in enumerate(d.unroll(ids, aux, 2)):
                a, b, c = ttt_slices(12, s)
                loss = loss + 0.8**s * loss_fn(logits[:, a], teacher[:, b], mask[:, c])
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    assert curves[0][-1] < 0.8 * curves[0][0]
    for a, b in zip(*curves):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a))


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
# (2, 23, 9, 3, 64, 90): 69 score rows a KV head, two tiles of 64 (45 queries took 12 s a dtype in the interpreter)
@pytest.mark.parametrize("B,n,nh,nkv,d,S", [(1, 1, 9, 3, 64, 300), (33, 1, 2, 2, 16, 37), (3, 3, 4, 2, 80, 130),
                                             (2, 5, 9, 3, 64, 300), (1, 16, 8, 1, 32, 70), (2, 23, 9, 3, 64, 90),
                                             (1, 3, 2, 1, 4, 40)])
def test_decode_attention_kernel_matches_reference(dtype, tol, B, n, nh, nkv, d, S):
    from draftsmith_kernels.decode_attention import decode_attention_reference, decode_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * n + d)
    q = torch.randn(B, nh, n, d, device=device).to(dtype)
    k_cache, v_cache = (torch.randn(B, nkv, S, d, device=device).to(dtype) for _ in range(2))
    # ragged rows at their own positions; position 0 (one visible key) and the cache's last slot
    start = torch.randint(0, S - n + 1, (B, 1), device=device)
    start[0] = 0
    start[-1] = S - n
    positions = start + torch.arange(n, device=device)
    ref = decode_attention_reference(q, k_cache, v_cache, positions)
    got = decode_attention_triton(q, k_cache, v_cache, positions)
    assert got.shape == ref.shape == (B, n, nh * d)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    # keys beyond a query's position are never read: poisoning them changes nothing
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    beyond = torch.arange(S, device=device)[None, :] > positions.max(1, keepdim=True).values  # [B,S]
    poisoned_k.transpose(1, 2)[beyond] = float("nan")
    poisoned_v.transpose(1, 2)[beyond] = float("nan")
    assert torch.equal(decode_attention_triton(q, poisoned_k, poisoned_v, positions), got)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,n,nh,nkv,d,S", [(2, 3, 9, 3, 64, 300), (3, 2, 4, 2, 16, 50)])
def test_both_merge_forms_of_a_chain_match_reference(dtype, tol, B, n, nh, nkv, d, S):
    """A chain's merge takes one query head a program on a GPU and all of a token's heads in the
    interpreter (kernels/decode_attention.py CHAIN_COMBINE_HEADS); the test above runs the
    device's default, this one both forms: each matches the reference, and in float32 each other."""
    from draftsmith_kernels.decode_attention import decode_attention_reference, decode_attention_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * n + d)
    q = torch.randn(B, nh, n, d, device=device).to(dtype)
    k_cache, v_cache = (torch.randn(B, nkv, S, d, device=device).to(dtype) for _ in range(2))
    positions = torch.randint(0, S - n + 1, (B, 1), device=device) + torch.arange(n, device=device)
    ref = decode_attention_reference(q, k_cache, v_cache, positions)
    one, all_heads = (decode_attention_triton(q, k_cache, v_cache, positions, combine_heads=h) for h in (1, 16))
    for got in (one, all_heads):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(one, all_heads, rtol=1e-6, atol=1e-6)


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,k,V", [(1, 1, 7), (33, 4, 1000), (3, 7, 4099), (5, 0, 50)])
def test_greedy_verify_kernel_matches_reference(dtype, B, k, V):
    from draftsmith_kernels.greedy_verify import greedy_verify_reference, greedy_verify_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * 100 + k)
    logits = torch.randn(B, k + 1, V, device=device).to(dtype)
    choice = logits.argmax(-1)
    # drafts that agree for a random prefix, then disagree (or run out: -1)
    drafts = choice[:, :k].clone()
    for b in range(B):
        cut = int(torch.randint(0, k + 1, ()))
        if cut < k:
            drafts[b, cut] = (choice[b, cut] + 1) % V if b % 2 else -1
    if V > 10:  # a tie: the lowest id must win, as in torch.argmax
        logits[0, 0, 3] = logits[0, 0, 5] = logits[0, 0].max() + 1
    if V > 2048 and B > 1:  # a tie across the kernel's chunks of 2,048 columns
        logits[1, 0, V - 1] = logits[1, 0, 2047] = logits[1, 0].max() + 1
    exp_acc, exp_bonus = greedy_verify_reference(drafts, logits)
    acc, bonus = greedy_verify_triton(drafts, logits)
    assert torch.equal(acc, exp_acc) and torch.equal(bonus, exp_bonus)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("nh,nkv,rest,d", [(4, 2, 2, 16), (0, 3, 3, 24), (9, 3, 3, 64)])
def test_head_norm_kernel_matches_reference_in_place(dtype, tol, nh, nkv, rest, d):
    from draftsmith_kernels.rms_norm import head_norm_reference, head_norm_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(nh + d)
    qkv = (torch.randn(2, 5, (nh + nkv + rest) * d, device=device) * 3).to(dtype)
    qw, kw = ((torch.rand(d, device=device) + 0.5).to(dtype) for _ in range(2))
    want, got = qkv.clone(), qkv.clone()
    head_norm_reference(want, qw if nh else None, kw, 1e-6, nh, nkv)
    assert head_norm_triton(got, qw if nh else None, kw, 1e-6, nh, nkv) is got  # in place
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[..., (nh + nkv) * d:], qkv[..., (nh + nkv) * d:])  # values untouched


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(1, 7), (3, 2048), (4, 4099), (2, 16384)])
@pytest.mark.parametrize("mapped", [False, True])
def test_argmax_rows_kernel_matches_reference(dtype, R, V, mapped):
    from draftsmith_kernels.argmax import CHUNK, argmax_rows_reference, argmax_rows_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(R * V)
    x = torch.randn(R, V, device=device).to(dtype)
    x[0, V // 3] = x[0, V - 1] = x[0].max() + 1  # a tie (across chunks when V > 2048): the lowest wins
    ids = torch.randperm(V * 2, device=device)[:V] if mapped else None  # draft rows → target ids
    want = argmax_rows_reference(x, torch.empty(R, dtype=torch.long, device=device), ids)
    # the output a strided column of a bigger buffer, as a drafter's chain writes it
    buffer = torch.full((R, 3), -7, dtype=torch.long, device=device)
    got = argmax_rows_triton(x, buffer[:, 1], ids, chunk=CHUNK)  # the GPU's chunks
    assert torch.equal(got, want) and torch.equal(buffer[:, 1], want)
    assert (buffer[:, [0, 2]] == -7).all()
    # a row of NaN (a broken forward) or of -inf still names a real column, never V
    bad = torch.stack([torch.full((V,), float("nan")), torch.full((V,), float("-inf"))]).to(device, dtype)
    got = argmax_rows_triton(bad, torch.empty(2, dtype=torch.long, device=device), chunk=CHUNK)
    assert ((got >= 0) & (got < V)).all() and got[1] == 0


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("rows,H", [(1, 7), (33, 576), (3, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_reference(dtype, tol, rows, H, with_residual):
    from draftsmith_kernels.rms_norm import rms_norm_reference, rms_norm_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(rows + H)
    x = (torch.randn(2, rows, H, device=device) * 4).to(dtype)
    w = (torch.rand(H, device=device) + 0.5).to(dtype)
    r = torch.randn(2, rows, H, device=device).to(dtype) if with_residual else None
    out, h = rms_norm_triton(x, w, 1e-5, r)
    ref_out, ref_h = rms_norm_reference(x, w, 1e-5, r)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    # the residual sum: exact in float32; low precision within one rounding (the CPU
    # interpreter's float→bf16 cast may truncate where a GPU rounds to nearest)
    exact = dtype == torch.float32
    torch.testing.assert_close(h.float(), ref_h.float(), rtol=0 if exact else 1e-2, atol=0 if exact else 1e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_kernel_writes_into_slices_and_looks_up_rows(dtype, tol):
    """out= / sum_out= halves of a bigger buffer (the drafter's [embedding; hidden] input, the
    target's aux features) and ids= (an embedding lookup fused into the norm)."""
    from draftsmith_kernels.rms_norm import rms_norm_reference, rms_norm_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    B, q, H, V = 2, 3, 40, 11
    x, r = torch.randn(B, q, H, device=device).to(dtype), torch.randn(B, q, H, device=device).to(dtype)
    w = (torch.rand(H, device=device) + 0.5).to(dtype)
    table, ids = torch.randn(V, H, device=device, dtype=torch.float32), torch.randint(0, V, (B, q), device=device)
    got = torch.full((B, q, 3 * H), 7.0, device=device, dtype=dtype)
    want = got.clone()
    rms_norm_triton(x, w, 1e-5, r, out=got[..., :H], sum_out=got[..., 2 * H:])
    rms_norm_reference(x, w, 1e-5, r, out=want[..., :H], sum_out=want[..., 2 * H:])
    rms_norm_triton(table, w, 1e-5, ids=ids, out=got[..., H: 2 * H])
    rms_norm_reference(table, w, 1e-5, ids=ids, out=want[..., H: 2 * H])
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="ids"):
        rms_norm_triton(table, w, 1e-5, r, ids=ids)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("rows,I", [(1, 3), (33, 1536), (2, 1000)])
def test_silu_mul_kernel_matches_reference(dtype, tol, rows, I):
    from draftsmith_kernels.silu_mul import silu_mul_reference, silu_mul_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(rows * I)
    gate_up = (torch.randn(rows, 1, 2 * I, device=device) * 3).to(dtype)
    torch.testing.assert_close(silu_mul_triton(gate_up).float(), silu_mul_reference(gate_up).float(), rtol=tol, atol=tol)


@needs_triton_backend
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
# (2, 21, ...): a tree verify step's many tokens a row
@pytest.mark.parametrize("B,n,nh,nkv,d", [(1, 1, 9, 3, 64), (33, 2, 4, 4, 16), (3, 5, 6, 2, 80), (2, 21, 3, 1, 16)])
def test_rope_cache_kernel_matches_reference(dtype, tol, B, n, nh, nkv, d):
    from draftsmith_kernels.rope_cache import rope_cache_reference, rope_cache_triton
    from models.layers import rope_inv_freq

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * n + d)
    S = 40
    qkv = torch.randn(B, n, (nh + 2 * nkv) * d, device=device).to(dtype)
    # ragged rows: each row writes at its own positions, some far into the cache
    start = torch.randint(0, S - n, (B, 1), device=device)
    positions = start + torch.arange(n, device=device)
    inv_freq = rope_inv_freq(d, 10000.0).to(device)
    caches = [torch.randn(B, nkv, S, d, device=device).to(dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    got_k, got_v = caches[0].clone(), caches[1].clone()
    ref_q = rope_cache_reference(qkv, positions, inv_freq, ref_k, ref_v, nh, nkv)
    got_q = rope_cache_triton(qkv, positions, inv_freq, got_k, got_v, nh, nkv)
    torch.testing.assert_close(got_q.float(), ref_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), ref_k.float(), rtol=tol, atol=tol)
    assert torch.equal(got_v, ref_v)  # v is copied, not computed
    untouched = torch.ones(B, S, dtype=torch.bool, device=device)
    untouched.scatter_(1, positions, False)
    assert torch.equal(got_k.transpose(1, 2)[untouched], caches[0].transpose(1, 2)[untouched])
    # K/V written at slots other than the RoPE positions (distinct per row, reversed order)
    slots = (S - 1 - positions).flip(1)
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    got_k, got_v = caches[0].clone(), caches[1].clone()
    ref_q = rope_cache_reference(qkv, positions, inv_freq, ref_k, ref_v, nh, nkv, slots=slots)
    got_q = rope_cache_triton(qkv, positions, inv_freq, got_k, got_v, nh, nkv, slots=slots)
    torch.testing.assert_close(got_q.float(), ref_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_k.float(), ref_k.float(), rtol=tol, atol=tol)
    assert torch.equal(got_v, ref_v)
    assert not torch.equal(got_k, caches[0])  # something was written
    # a tree verify step: positions root, root + depth ..., slots root, root + 1, root + 2, ...
    tree_positions = start + torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device),
                                        torch.randint(1, 4, (B, n - 1), device=device)], 1)
    block = start + torch.arange(n, device=device)
    want_k, want_v = caches[0].clone(), caches[1].clone()
    want_q = rope_cache_reference(qkv, tree_positions, inv_freq, want_k, want_v, nh, nkv, slots=block)
    for fn in (rope_cache_reference, rope_cache_triton):
        got_k, got_v = caches[0].clone(), caches[1].clone()
        got_q = fn(qkv, tree_positions, inv_freq, got_k, got_v, nh, nkv, tree_block=True)
        torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(got_k.float(), want_k.float(), rtol=tol, atol=tol)
        assert torch.equal(got_v, want_v), fn.__name__


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,k,V,with_q", [(1, 1, 7, True), (33, 4, 1000, False), (3, 7, 4099, True), (5, 0, 50, False)])
def test_rejection_sample_kernel_matches_reference(dtype, B, k, V, with_q):
    from draftsmith_kernels.rejection_sample import rejection_sample_reference, rejection_sample_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(B * 7 + k)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g) * 2, -1).to(dtype).to(device)
    q = torch.softmax(torch.randn(B, k, V, generator=g) * 2, -1).to(dtype).to(device) if with_q else None
    drafts = torch.randint(0, V, (B, k), generator=g).to(device)
    if k:
        drafts[0, -1] = -1  # an empty slot
        drafts[1 % B, 0] = p[1 % B, 0].float().argmax()  # a likely draft
    u_accept = torch.rand(B, k, generator=g).to(device)
    u_sample = torch.rand(B, generator=g).to(device)
    ref = rejection_sample_reference(drafts, q, p, u_accept, u_sample)
    got = rejection_sample_triton(drafts, q, p, u_accept, u_sample)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])


@needs_triton_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,k,V,with_q", [(1, 1, 7, True), (33, 4, 1000, False), (3, 7, 4099, True), (5, 0, 50, False)])
def test_block_sample_kernel_matches_reference(dtype, B, k, V, with_q):
    from draftsmith_kernels.block_sample import block_sample_reference, block_sample_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(B * 11 + k)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g) * 2, -1).to(dtype).to(device)
    q = torch.softmax(torch.randn(B, k, V, generator=g) * 2, -1).to(dtype).to(device) if with_q else None
    drafts = torch.randint(0, V, (B, k), generator=g).to(device)
    if k:
        drafts[0, -1] = -1
        drafts[1 % B, 0] = p[1 % B, 0].float().argmax()
    eta = torch.rand(B, k, generator=g).to(device)
    u_sample = torch.rand(B, generator=g).to(device)
    ref = block_sample_reference(drafts, q, p, eta, u_sample)
    got = block_sample_triton(drafts, q, p, eta, u_sample)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])


@needs_triton_backend
@pytest.mark.parametrize("B,k", [(1, 1), (5, 4), (3, 7), (2, 0), (3, 24)])
@pytest.mark.parametrize("tree", [False, True])
def test_feed_kernel_matches_reference(B, k, tree):
    """A chain's input (positions one after another) and a tree's (each node at its own
    position, given)."""
    from draftsmith_kernels.emit import feed_reference, feed_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B + k)
    tokens = torch.randint(0, 50, (B, 40), device=device)
    length = torch.randint(1, 40 - k, (B,), device=device)
    drafts = torch.randint(-1, 50, (B, k), device=device)  # -1: an empty slot, fed as token 0
    draft_positions = length[:, None] - 1 + torch.randint(1, 5, (B, k), device=device) if tree else None
    want = [torch.full((B, k + 1), -9, dtype=torch.long, device=device) for _ in range(2)]
    got = [w.clone() for w in want]
    feed_reference(tokens, length, drafts, *want, draft_positions)
    feed_triton(tokens, length, drafts, *got, draft_positions)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0][:, 0], tokens.gather(1, (length - 1)[:, None])[:, 0])
    assert torch.equal(want[1][:, 0], length - 1)
    if tree:
        assert torch.equal(want[1][:, 1:], draft_positions)


@needs_triton_backend
@pytest.mark.parametrize("B,k,E", [(1, 1, 1), (7, 4, 2), (5, 7, 1), (3, 0, 1)])
def test_emit_kernel_matches_reference(B, k, E):
    """Ragged rows, finished rows, drafts with empty slots, end-of-sequence tokens among the
    accepted ones and budgets cutting a step short: every state tensor as the reference leaves it."""
    from draftsmith_kernels.emit import emit_reference, emit_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * 10 + k)
    S, V = 40, 12  # a small vocabulary: end-of-sequence ids come up often
    changed = 0
    for trial in range(6):
        drafts = torch.randint(0, V, (B, k), device=device)
        drafts[torch.rand(B, k, device=device) < 0.2] = -1
        accepted = torch.randint(0, k + 1, (B,), device=device)
        bonus = torch.randint(0, V, (B,), device=device)
        eos = torch.randperm(V, device=device)[:E]
        budget = torch.tensor([int(torch.randint(5, 30, ()))], device=device)
        length = torch.randint(1, S - k - 1, (B,), device=device)
        n_out = torch.randint(0, 30, (B,), device=device).minimum(budget - 1)
        state = dict(tokens=torch.randint(0, V, (B, S), device=device), length=length, n_out=n_out,
                     done=torch.rand(B, device=device) < 0.3, histogram=torch.randint(0, 3, (B, k + 1), device=device),
                     row_steps=torch.randint(0, 9, (B,), device=device))
        if trial % 2:  # the rows still running after the step, written for the launches that follow
            state["active_out"] = torch.rand(B, device=device) < 0.5
        ref = {name: t.clone() for name, t in state.items()}
        got = {name: t.clone() for name, t in state.items()}
        emit_reference(drafts, accepted, bonus, eos, budget, **ref)
        emit_triton(drafts, accepted, bonus, eos, budget, **got)
        for name in state:
            assert torch.equal(got[name], ref[name]), (trial, name)
        if trial % 2:
            assert torch.equal(got["active_out"], ~got["done"])
        changed += not all(torch.equal(ref[name], state[name]) for name in state)
    assert changed  # some steps emitted (not every row was finished)


@needs_triton_backend
@pytest.mark.parametrize("B,S,k,min_n,max_n", [(1, 5, 1, 1, 1), (6, 40, 4, 1, 4), (3, 70, 7, 2, 3), (4, 9, 3, 1, 12)])
def test_ngram_kernel_matches_reference(B, S, k, min_n, max_n):
    """Rows of small vocabularies (many repeats), lengths from 0 to the whole buffer, sizes
    larger than the buffer: the drafts of the torch form."""
    from draftsmith_kernels.ngram import ngram_drafts_reference, ngram_drafts_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(B * S + k)
    for trial in range(4):
        buffer = torch.randint(0, 3 + trial, (B, S), device=device)
        lengths = torch.randint(0, S + 1, (B,), device=device)
        lengths[0] = S
        ref = ngram_drafts_reference(buffer, lengths, k, min_n, max_n)
        got = ngram_drafts_triton(buffer, lengths, k, min_n, max_n)
        assert torch.equal(got, ref), (trial, got, ref)
    assert (ref >= 0).any() or S < 6  # matches were found


def test_import_kernels_is_hugging_faces_package_even_from_the_repository_root():
    """The project's Triton code is `draftsmith_kernels`; `import kernels` run from the repository
    root (where the kernels/ folder is on the path) must give Hugging Face's package where it is
    installed (transformers >= 5.25 imports it), and never this folder as a regular package."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert not (root / "kernels" / "__init__.py").exists()
    code = ("import importlib.util, kernels, draftsmith_kernels.dispatch as d; "
            "print(getattr(kernels, '__file__', None)); print(d.__file__); "
            "print(importlib.util.find_spec('kernels').origin)")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    # Hugging Face's package is in the test extra (pyproject.toml), as in a serving environment
    assert run.returncode == 0, run.stderr
    kernels_file, dispatch_file, _ = run.stdout.splitlines()
    assert not kernels_file.startswith(str(root)), kernels_file
    assert dispatch_file.startswith(str(root / "kernels")), dispatch_file
