"""The recurrent-state rollback kernel (kernels/state_rollback.py) against its torch reference, on
CPU through TRITON_INTERPRET=1 (set in conftest): odd shapes, strided views, dtypes, the clamp."""
import pytest
import torch

from tests.conftest import kernel_device


@pytest.fixture
def dev():
    return kernel_device()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (2, 4, 3, 33), (5, 2, 1100)])
def test_state_rollback_matches_reference(dev, dtype, shape):
    """Rows that keep their first, last and middle positions; a state size under, over and far from
    a power of two (1,100: more than one GPU tile); a state of more than one dimension."""
    from draftsmith_kernels.state_rollback import state_rollback_reference, state_rollback_triton

    g = torch.Generator().manual_seed(sum(shape))
    B, P = shape[:2]
    states = torch.randn(*shape, generator=g).to(dev, dtype)
    n_acc = torch.randint(0, P, (B,), generator=g).to(dev)
    n_acc[0] = P - 1
    want = state_rollback_reference(states, n_acc, torch.zeros(B, *shape[2:], dtype=dtype, device=dev))
    got = state_rollback_triton(states, n_acc, torch.full((B, *shape[2:]), -7.0, dtype=dtype, device=dev))
    assert torch.equal(got, want)
    for b in range(B):  # and the reference is what the docstring says
        assert torch.equal(want[b], states[b, int(n_acc[b])])


def test_state_rollback_strided_and_in_place(dev):
    """The states a column slice of a wider buffer (row and position strides not the packed ones),
    out a slice of a bigger live state (written in place, its neighbours untouched), int32 counts,
    a second tile forced by a small block."""
    from draftsmith_kernels.state_rollback import state_rollback_triton

    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 6, 50, generator=g).to(dev)
    states = wide[:, 1:5, 3:40]  # [4, 4, 37]
    live = torch.full((4, 60), -1.0, device=dev)
    out = live[:, 10:47]
    n_acc = torch.tensor([0, 3, 1, 2], dtype=torch.int32, device=dev)
    state_rollback_triton(states, n_acc, out, block=16)
    for b in range(4):
        assert torch.equal(live[b, 10:47], states[b, int(n_acc[b])])
    assert (live[:, :10] == -1).all() and (live[:, 47:] == -1).all()


def test_state_rollback_clamps_counts_and_rejects_bad_shapes(dev):
    from draftsmith_kernels.state_rollback import state_rollback_reference, state_rollback_triton

    states = torch.arange(2 * 3 * 4, dtype=torch.float32, device=dev).view(2, 3, 4)
    n_acc = torch.tensor([-2, 9], device=dev)
    got = state_rollback_triton(states, n_acc, torch.empty(2, 4, device=dev))
    assert torch.equal(got, torch.stack([states[0, 0], states[1, 2]]))
    assert torch.equal(state_rollback_reference(states, n_acc, torch.empty(2, 4, device=dev)), got)
    with pytest.raises(ValueError, match="state_rollback"):
        state_rollback_triton(states, n_acc, torch.empty(2, 5, device=dev))
    with pytest.raises(ValueError, match="n_acc"):
        state_rollback_triton(states, n_acc[:1], torch.empty(2, 4, device=dev))
