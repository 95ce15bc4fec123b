"""Soft-label KL loss over the draft vocabulary, fused: loss and gradient in one kernel.

    loss = mean over masked rows of  KL(p || softmax(z)) = sum_v p (log p - z) + lse(z) * sum_v p
    dL/dz = (softmax(z) * sum_v p - p) / n_masked

The plain-torch version materialises log_softmax, p * log q and their gradients in float32 for
every [rows, Vd] step of the TTT unroll (40 % of a training step's device time in the profile,
BENCHMARKS.md). The kernel streams each row twice in blocks (online max / sum-exp, then the
gradient) and keeps only the gradient, in the logits' dtype.

`soft_kl` dispatches: the Triton kernel on CUDA (or anywhere with TRITON_INTERPRET=1 when
asked), else the reference. Both have the same signature.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a dependency, but keep the reference usable without it
    triton = None


def soft_kl_reference(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged over the mask.

    student_logits, teacher_probs [..., Vd]; mask [...]. Computed in float32; the teacher
    entropy term makes the value a true KL (0 when the two agree); it adds no gradient.
    """
    logq = F.log_softmax(student_logits.float(), dim=-1)
    p = teacher_probs.float()
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-30)), torch.zeros_like(p))
    kl = (plogp - p * logq).sum(-1)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp_min(1.0)


if triton is not None:

    @triton.jit
    def _soft_kl_kernel(z_ptr, p_ptr, w_ptr, inv_count_ptr, loss_ptr, grad_ptr, V, z_stride, p_stride, g_stride,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row)  # 1.0 for masked-in rows, 0.0 otherwise
        inv_count = tl.load(inv_count_ptr)  # 1 / number of masked-in rows (no host sync)
        z_row = z_ptr + row * z_stride
        p_row = p_ptr + row * p_stride
        g_row = grad_ptr + row * g_stride
        # pass 1: online log-sum-exp of z, and the sums that the loss needs
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        plogp = tl.zeros([BLOCK], tl.float32)
        pz = tl.zeros([BLOCK], tl.float32)
        psum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, z)
            s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)
            m = m_new
            plogp += tl.where(p > 0, p * tl.log(tl.maximum(p, 1e-30)), 0.0)
            pz += tl.where(ok, p * z, 0.0)
            psum += p
        m_all = tl.max(m, 0)
        lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), 0))
        p_total = tl.sum(psum, 0)
        loss = tl.sum(plogp, 0) - tl.sum(pz, 0) + lse * p_total
        tl.store(loss_ptr + row, loss * w * inv_count)
        # pass 2: gradient of the masked mean
        scale = w * inv_count
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            p = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
            g = (tl.exp(z - lse) * p_total - p) * scale
            tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=ok)


class _SoftKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher, mask):
        V = logits.shape[-1]
        z = logits.reshape(-1, V)
        p = teacher.reshape(-1, V)
        if z.stride(-1) != 1:
            z = z.contiguous()
        if p.stride(-1) != 1:
            p = p.contiguous()
        w = mask.reshape(-1).to(torch.float32).contiguous()
        inv_count = 1.0 / w.sum().clamp_min(1.0).reshape(1)
        rows = z.shape[0]
        loss_rows = torch.empty(rows, dtype=torch.float32, device=z.device)
        grad = torch.empty((rows, V), dtype=logits.dtype, device=z.device)
        if rows:
            block = min(4096, triton.next_power_of_2(V))
            _soft_kl_kernel[(rows,)](z, p, w, inv_count, loss_rows, grad, V, z.stride(0), p.stride(0), grad.stride(0),
                                      BLOCK=block)
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return loss_rows.sum()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype)).view(ctx.shape), None, None


def soft_kl_triton(student_logits, teacher_probs, mask) -> torch.Tensor:
    """Same as soft_kl_reference, as one Triton kernel (loss and gradient in one pass)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    return _SoftKL.apply(student_logits, teacher_probs, mask)


def soft_kl(student_logits, teacher_probs, mask) -> torch.Tensor:
    """The kernel on CUDA tensors, the reference elsewhere (kernels/dispatch.py use_kernel)."""
    from draftsmith_kernels.dispatch import use_kernel

    return (soft_kl_triton if use_kernel(student_logits) else soft_kl_reference)(student_logits, teacher_probs, mask)
