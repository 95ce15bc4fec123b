"""The device loop (inference/runtime/spec_loop.py) emits exactly what the host loop emits, step for step.

float32 on a tiny random Llama: for every device proposer, the outputs, the per-row
accepted-length histograms, the step counts and every step's drafts equal the host loop's
(`generate(..., device_loop=False)`), and both equal plain greedy decoding. On a GPU the
captured graphs give what the same loop gives eagerly.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from inference.proposers import DraftModelProposer, GpuNgramProposer, NgramProposer, drafter_proposer
from inference.runtime.verify import NO_DRAFT
from draftsmith_kernels.settings import KernelSettings, applied
from tests.conftest import kernel_device
from tests.test_sampling import assert_first_two_tokens_follow, eight_token_target

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU (the CPU cases run the same loop)")


def gpu_case(tiny_target, max_new: int, k: int):
    """The graphed-against-eager GPU cases' setup: the tiny target in float32 (transformers' and
    the runtime's on CUDA), four ragged prompts, their cache size for k drafts and plain greedy's
    outputs. → (hf, rt, prompts, max_new, eos, max_len, plain)"""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target, device="cuda")
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)] + [[7, 8, 9, 10] * 4]
    eos = (rt.config.vocab_size - 1,)
    n = cache_size(prompts, max_new, k)
    plain, _ = generate(rt, prompts, max_new, eos_ids=eos, max_len=n)
    return hf, rt, prompts, max_new, eos, n, plain


def _random_drafters(hf, seed=0):
    """EAGLE-3 (both norm placements), EAGLE-1, Medusa, MTP and DFlash with small random
    weights: their drafts are sometimes right, mostly wrong (bookkeeping is what is checked)."""
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle1 import Eagle1Config, Eagle1Drafter
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.mtp import MTPConfig, MTPDrafter

    V = hf.config.vocab_size
    keep = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    torch.manual_seed(seed)
    drafters = {
        "eagle3": Eagle3Drafter(Eagle3Config.from_target(hf.config, V)),
        "eagle3-norms": Eagle3Drafter(Eagle3Config.from_target(hf.config, V, norm_before_fc=True, norm_before_residual=True)),
        "eagle1": Eagle1Drafter(Eagle1Config.from_target(hf.config, V)),
        "medusa": MedusaDrafter(MedusaConfig.from_target(hf.config, V, num_heads=3)),
        "mtp": MTPDrafter(MTPConfig.from_target(hf.config, V, 3)),
        "dflash": DFlashDrafter(DFlashConfig.from_target(hf.config, V, 0, num_layers=1, block_size=4)),
    }
    for d in drafters.values():
        for name, p in d.named_parameters():
            if "embed" not in name and p.dim() > 1:
                torch.nn.init.normal_(p, std=0.05)
        d.init_from_target(hf, *keep)
        d.eval()
    return drafters


def _recorded(proposer, calls, on_device: bool):
    """Record every draft the proposer makes (the device loop calls `draft`, the host loop
    `propose`, which may call `draft` itself)."""
    if on_device:
        draft = proposer.draft
        proposer.draft = lambda: calls.append(draft().tolist()) or proposer.drafts
    else:
        propose = proposer.propose
        proposer.propose = lambda tokens: calls.append(propose(tokens)) or calls[-1]
    return proposer


@pytest.fixture(scope="module")
def tiny(tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    # ragged prompts; a repeated pattern gives the n-gram drafter something to find
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)] + [[7, 8, 9, 10] * 4]
    return hf, rt, prompts


def test_device_loop_equals_the_host_loop_for_every_device_proposer(tiny):
    hf, rt, prompts = tiny
    max_new, eos = 24, (rt.config.vocab_size - 1, 1880)
    plain, _ = generate(rt, prompts, max_new, eos_ids=eos)
    n = cache_size(prompts, max_new, 4)
    drafters = _random_drafters(hf)
    draft_model = RuntimeModel.from_pretrained(hf.name_or_path)
    with torch.no_grad():  # a draft model that agrees with the target most of the time, not always
        draft_model.layers[-1].mlp.down_proj.weight.mul_(1.5)
    makers = {name: (lambda d=d: drafter_proposer(d, 3, len(prompts), n, rt.config)) for name, d in drafters.items()}
    makers["ngram-gpu"] = lambda: GpuNgramProposer(4, len(prompts), n, max_n=3)
    makers["draft-model"] = lambda: DraftModelProposer(draft_model, 4, len(prompts), n, rt.config)
    partly = 0
    for name, make in makers.items():
        host_calls, device_calls = [], []
        host, host_stats = generate(rt, prompts, max_new, proposer=_recorded(make(), host_calls, False), eos_ids=eos, max_len=n,
                                    device_loop=False)
        dev, dev_stats = generate(rt, prompts, max_new, proposer=_recorded(make(), device_calls, True), eos_ids=eos, max_len=n)
        assert dev_stats.device_loop and not host_stats.device_loop
        assert dev == host == plain, name
        assert dev_stats.row_histograms == host_stats.row_histograms, name
        assert dev_stats.steps == host_stats.steps, name
        # the same drafts at every step, every row (the device loop drafts once more after its
        # last step: the proposer's graph takes in the last step and drafts the next chain)
        assert device_calls[:-1] == host_calls and len(device_calls) == len(host_calls) + 1, name
        k = host_stats.k
        partly += sum(sum(row[1:k]) > 0 for row in host_stats.row_histograms)  # rows with partly accepted chains
    assert partly >= 3, "no proposer had chains that were partly accepted: the check would miss an off-by-one"


def test_phases_hand_each_other_the_same_tensors_every_step(tiny):
    """On a GPU the first draft, the verify step and the proposer's step are separate CUDA graphs:
    what one phase leaves for the next (drafts, q, a draft tree) must sit in
    the same tensors whichever graph wrote it, or a replay reads what an earlier graph left (the
    graphed tree loop verified its first tree at every step). Checked here by identity, eagerly,
    for what two graphs write (the drafts: the first draft's graph and the proposer's); what
    only the verify graph writes keeps its addresses in that graph's pool."""
    from inference.tree.loop import EagleTreeProposer

    hf, rt, prompts = tiny
    max_new, eos = 8, (rt.config.vocab_size - 1,)
    n = cache_size(prompts, max_new, 8)
    drafters = _random_drafters(hf)
    makers = {name: (lambda d=d: drafter_proposer(d, 3, len(prompts), n, rt.config)) for name, d in drafters.items()}
    makers["ngram-gpu"] = lambda: GpuNgramProposer(4, len(prompts), n, max_n=3)
    makers["tree"] = lambda: EagleTreeProposer(drafters["eagle3"], 3, 2, 5, len(prompts), n, rt.config)
    for name, make in makers.items():
        generate(rt, prompts, max_new, proposer=make(), eos_ids=eos, max_len=n)
        loop = next(v for key, v in reversed(rt._workspace.items()) if key[0] == "spec")
        handed = lambda: [v for v in (getattr(loop, "drafts", None), getattr(loop, "q", None),
                                      *(loop.buffers.tree if name == "tree" else ())) if isinstance(v, torch.Tensor)]
        with torch.no_grad():
            loop.draft_phase()
            first = handed()
            loop.verify_phase()
            loop.proposer_phase()
        assert first and all(a is b for a, b in zip(first, handed())), name


def test_rows_that_finish_apart_keep_every_cache_write_inside_its_row(tiny):
    """Synthetic acceptance (each draft taken with probability 0.8) makes rows overshoot their
    budget in their last step at different times: the loop cuts each row at its budget, and the
    drafter's cache is never written past its end (an out-of-range write raises on a CPU)."""
    hf, rt, _ = tiny
    drafter = _random_drafters(hf)["eagle3"]
    torch.manual_seed(5)
    prompts = [torch.randint(0, 40000, (9,)).tolist() for _ in range(6)]
    k, max_new = 4, 24
    size = cache_size(prompts, max_new, k)
    proposer = drafter_proposer(drafter, k, len(prompts), size, rt.config)
    reach = []
    advance = proposer.advance
    proposer.advance = lambda *a: (advance(*a), reach.append(int(proposer.last.max()) + k + 1))
    outs, stats = generate(rt, prompts, max_new, proposer=proposer, verification="synthetic:0.8", max_len=size,
                           generator=torch.Generator().manual_seed(0))
    assert stats.device_loop and all(len(o) == max_new for o in outs)
    steps = [sum(row) for row in stats.row_histograms]
    assert len(set(steps)) > 1, "every row took as many steps: none finished before the others"
    assert max(reach) <= size


class _FixedDeviceDrafts:
    """A device proposer that always drafts the same tokens (no probabilities)."""

    aux_layers = ()
    on_device = True

    def __init__(self, drafts, batch):
        self.k = len(drafts)
        self.drafts = torch.tensor([drafts] * batch)

    def begin(self, *a):
        pass

    def draft(self):
        return self.drafts

    def advance(self, *a):
        pass


@pytest.mark.parametrize("drafts,verification", [([3, 5], "standard"), ([3, NO_DRAFT], "standard"),
                                                  ([3, 5], "block"), ([3, NO_DRAFT], "block")])
def test_sampling_through_the_device_loop_follows_the_target(tmp_path, drafts, verification):
    """The first two sampled tokens follow softmax(logits / T) (8-token vocabulary, 20,000 rows
    in one batch), through the device loop with fixed drafts and no q."""
    hf, rt = eight_token_target(tmp_path)
    prompt, T, N = [1, 2, 3, 4], 0.8, 20_000
    outs, stats = generate(rt, [prompt] * N, 2, proposer=_FixedDeviceDrafts(drafts, N), temperature=T,
                           generator=torch.Generator().manual_seed(1), verification=verification)
    assert stats.device_loop and sum(n * c for n, c in enumerate(stats.histogram)) > 1000  # drafts were accepted
    assert_first_two_tokens_follow(hf, prompt, outs, T)


@pytest.mark.gpu
@needs_cuda
def test_graphed_device_loop_equals_the_eager_one_on_a_gpu(tiny_target):
    """float32 on CUDA: each proposer's step captured in CUDA graphs emits what the same loop
    emits eagerly, with the same histograms, and both equal plain greedy decoding."""
    hf, rt, prompts, max_new, eos, n, plain = gpu_case(tiny_target, max_new=40, k=4)
    drafters = {name: d.cuda() for name, d in _random_drafters(hf).items()}
    makers = {name: (lambda d=d: drafter_proposer(d, 3, len(prompts), n, rt.config)) for name, d in drafters.items()}
    makers["ngram-gpu"] = lambda: GpuNgramProposer(4, len(prompts), n, max_n=3, device="cuda")
    makers["draft-model"] = lambda: DraftModelProposer(rt, 4, len(prompts), n, rt.config)
    makers["ngram-host"] = lambda: NgramProposer(4, max_n=3)  # the host loop's greedy step in one graph
    for name, make in makers.items():
        eager, eager_stats = generate(rt, prompts, max_new, proposer=make(), eos_ids=eos, max_len=n, cuda_graphs=False)
        proposer = make()
        for _ in range(2):  # the second call replays the graphs captured by the first
            graphed, graphed_stats = generate(rt, prompts, max_new, proposer=proposer, eos_ids=eos, max_len=n)
            assert graphed == eager == plain, name
            assert graphed_stats.row_histograms == eager_stats.row_histograms, name
            # memory freed since the capture is handed out again, filled with junk: a graph that
            # reads a tensor nobody holds (kept only by a capturing closure) now reads junk
            junk = [torch.full((size,), 10**6, dtype=torch.long, device="cuda") for size in range(1, 600) for _ in range(2)]
        del junk
    assert any(key[0] == "host-greedy" for key in rt._workspace)  # the host loop's one-graph greedy step ran
    # sampling inside the graphs: runs, and the tokens stay in the vocabulary
    proposer = drafter_proposer(drafters["eagle3"], 3, len(prompts), n, rt.config)
    outs, stats = generate(rt, prompts, max_new, proposer=proposer, temperature=1.0, max_len=n)
    assert stats.device_loop and all(0 <= t < rt.config.vocab_size for o in outs for t in o)


@pytest.mark.gpu
@needs_cuda
def test_the_graphed_loop_runs_no_step_past_the_budget_and_at_most_one_past_eos(tiny_target):
    """On a GPU the host checks the rows after every group of SPEC_CHECK_EVERY (2) steps, right after
    the group's last verification: a row that reaches its budget runs no step more, and one that
    ends at an end-of-sequence token at most one (`launched_steps` against `steps`; the second call
    replays the graphs, without the capture's two warm-up steps)."""
    from inference.runtime.spec_loop import SPEC_CHECK_EVERY

    hf, rt, prompts, max_new, _, n, _ = gpu_case(tiny_target, max_new=40, k=4)
    prompt = prompts[3]  # a repeating prompt: the n-gram drafts get accepted
    free, _ = generate(rt, [prompt], max_new, eos_ids=(), max_len=n)
    proposer = GpuNgramProposer(4, 1, n, max_n=3, device="cuda")
    for _ in range(2):
        out, stats = generate(rt, [prompt], max_new, proposer=proposer, eos_ids=(), max_len=n)
    assert out == free and len(out[0]) == max_new
    assert stats.launched_steps == stats.steps, (stats.launched_steps, stats.steps)
    # an end-of-sequence token the answer reaches mid-way (its first appearance) ends it there
    at = next((i for i in range(8, max_new) if free[0][i] not in free[0][:i]), None)
    assert at is not None, free
    eos = (free[0][at],)
    for _ in range(2):
        out, stats = generate(rt, [prompt], max_new, proposer=proposer, eos_ids=eos, max_len=n)
    assert out == [free[0][: at + 1]]
    assert stats.steps <= stats.launched_steps <= stats.steps + SPEC_CHECK_EVERY - 1, (stats.launched_steps, stats.steps)


def kernel_case(tiny_target, k: int):
    """The kernels-against-torch cases' setup (skipped without CUDA or TRITON_INTERPRET=1): the
    tiny target in float32 on the kernels' device, two ragged prompts, their cache size for k
    drafts and plain greedy's outputs. → (device, hf, rt, prompts, max_new, eos, max_len, plain)"""
    device = kernel_device()
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target, device=device)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [3, 4, 3, 4, 3]]
    max_new, eos = 8, (rt.config.vocab_size - 1,)
    n = cache_size(prompts, max_new, k)
    plain, _ = generate(rt, prompts, max_new, eos_ids=eos, max_len=n, cuda_graphs=False)
    return device, hf, rt, prompts, max_new, eos, n, plain


def test_device_loop_through_the_kernels_equals_the_torch_path(tiny_target):
    """float32, every runtime kernel on (the Triton interpreter on a CPU): the device loop with
    the EAGLE-3, MTP and DFlash proposers (RoPE written at slots, decode attention, fused emission)
    emits what it emits through the torch references, with the same histograms."""
    device, hf, rt, prompts, max_new, eos, n, plain = kernel_case(tiny_target, 3)
    drafters = _random_drafters(hf)
    makers = {name: (lambda d=drafters[name].to(device): drafter_proposer(d, 3, len(prompts), n, rt.config))
              for name in ("eagle3", "mtp", "dflash")}
    makers["ngram-gpu"] = lambda: GpuNgramProposer(3, len(prompts), n, max_n=2, device=device)  # accepts drafts here
    accepted = 0
    for name, make in makers.items():
        results = []
        for mode in ("off", "force"):
            outs, stats = generate(rt, prompts, max_new, proposer=make(), eos_ids=eos, max_len=n, cuda_graphs=False,
                                   kernels=KernelSettings(mode=mode))
            results.append((outs, stats.row_histograms))
        assert results[0] == results[1], name
        assert results[0][0] == plain, name
        accepted += sum(n * c for h in results[0][1] for n, c in enumerate(h))
    assert accepted > 0  # emission of accepted drafts went through the kernel too



def test_eagle3_chain_step_through_the_one_row_kernels_equals_the_torch_path(tiny_target, monkeypatch):
    """Batch 1, one token (a chain step): the EAGLE-3 layer runs its projections through
    kernels/gemv.py (one row; the down projection reads silu(gate) * up and adds the residual in
    place) and, float32, computes what the torch path computes, cache entries included."""
    import draftsmith_kernels.gemv
    from inference.proposers.drafters import _eagle3_layer

    device = kernel_device()
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    drafter = _random_drafters(hf)["eagle3"].to(device)
    launches = []
    launch = draftsmith_kernels.gemv._launch
    monkeypatch.setattr(draftsmith_kernels.gemv, "_launch", lambda *a, **kw: launches.append(kw["swiglu"]) or launch(*a, **kw))
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([[17]], device=device)
    hidden = torch.randn(1, 1, drafter.config.hidden_size, generator=g).to(device)
    results = []
    for mode in ("off", "force"):
        with applied(KernelSettings(mode=mode)):
            p = drafter_proposer(drafter, 3, 1, 16, None)
            assert p.one_row_kernels
            torch.manual_seed(1)
            p.k_cache.normal_(), p.v_cache.normal_()  # earlier entries the step attends to
            out = _eagle3_layer(p, tokens, hidden.clone(), torch.tensor([[5]], device=device))
        results.append((out, p.k_cache.clone(), p.v_cache.clone()))
    assert launches == [False, False, False, True]  # q/k/v, o, gate_up, then down with silu(gate) * up
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
