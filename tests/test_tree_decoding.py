"""Greedy tree decoding in the device loop (inference/tree/loop.py) is lossless: outputs
equal plain greedy decoding in float32, on ragged batches with EOS and budgets, whether the
trees are mostly rejected (a random EAGLE-3 drafter) or mostly accepted deep down (an oracle
that hides the target's own continuation among wrong siblings, so the KV compaction of long
accepted paths is exercised step after step)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith_kernels.settings import KernelSettings, applied
from inference.runtime.engine import cache_size, generate
from inference.runtime.model import RuntimeModel
from inference.tree.ops import Tree
from inference.tree.loop import EagleTreeProposer
from tests.conftest import kernel_device
from tests.tree_reference import static_tree


class OracleTree:
    """A full `width`-ary tree of `depth` levels per step. At each depth the target's plain
    greedy continuation sits under one pseudo-random choice (absent with probability `miss`),
    the other choices hold wrong tokens: the accepted path takes random turns and lengths."""

    tree = True
    on_device = True
    aux_layers = ()

    def __init__(self, continuations, width: int, depth: int, vocab: int, miss: float = 0.25, seed: int = 0):
        self.k, self.width, self.vocab, self.miss = depth, width, vocab, miss
        self.paths = [p for d in range(1, depth + 1) for p in _tuples(width, d)]
        self.verify_tokens = len(self.paths)
        self.cont = continuations  # [B, L]: each row's plain greedy output
        self.generator = torch.Generator().manual_seed(seed)

    def begin(self, prompts, aux, first):
        dev = self.cont.device  # (the loop's: a CPU, or the GPU the kernels run on)
        self.n_out = torch.ones(len(prompts), dtype=torch.long, device=dev)  # tokens emitted (the prefill's first)
        self.base = torch.as_tensor([len(p) for p in prompts], device=dev)  # the root's position

    def draft_tree(self):
        B, L = self.cont.shape
        dev = self.cont.device
        index = (self.n_out[:, None] + torch.arange(self.k, device=dev)).clamp_max(L - 1)  # next tokens to predict
        right = self.cont.gather(1, index)  # [B,D]
        wrong = (right[..., None] + 1 + torch.arange(self.width, device=dev)) % self.vocab  # [B,D,W], never `right`
        slot = torch.randint(0, self.width, (B, self.k), generator=self.generator).to(dev)
        hit = (torch.rand(B, self.k, generator=self.generator) >= self.miss).to(dev)
        candidates = wrong.scatter(2, slot[..., None], torch.where(hit, right, wrong[..., 0])[..., None])
        return static_tree(self.paths, candidates, self.base)

    def advance(self, fed, aux, accepted, bonus, active, aux_rows=None):  # (a tree proposer's: TreeLoop)
        self.n_out += torch.where(active, accepted + 1, 0)
        self.base += torch.where(active, accepted + 1, 0)


def _tuples(width, depth):
    if depth == 0:
        return [()]
    return [p + (c,) for p in _tuples(width, depth - 1) for c in range(width)]


def _random_eagle3(hf):
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    V = hf.config.vocab_size
    torch.manual_seed(0)
    d = Eagle3Drafter(Eagle3Config.from_target(hf.config, V))
    for name, p in d.named_parameters():
        if "embed" not in name and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.05)
    d.init_from_target(hf, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return d.eval()


def _check_lossless(rt, hf, prompts, max_new, eos, batch, plain=None,
                    names=("oracle", "eagle3", "eagle3, 2 children")):
    """plain: plain greedy's outputs for these prompts (computed here in batches of `batch` when None).
    names: the proposers (the last: kept nodes expanded into fewer children)."""
    if plain is None:
        plain = []
        for i in range(0, len(prompts), batch):
            plain.extend(generate(rt, prompts[i : i + batch], max_new, eos_ids=eos)[0])
    drafter = _random_eagle3(hf)
    deep = 0
    for name in names:
        got = []
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            n = cache_size(chunk, max_new, 16)
            if name == "oracle":
                width = max(len(o) for o in plain[i : i + batch])
                cont = torch.tensor([o + [0] * (width - len(o)) for o in plain[i : i + batch]])
                proposer = OracleTree(cont, width=2, depth=3, vocab=rt.config.vocab_size, seed=i)
            else:
                proposer = EagleTreeProposer(drafter, depth=3, top_k=3, total_tokens=10, batch=len(chunk), max_len=n,
                                             target_config=rt.config, children=2 if "children" in name else None)
            outs, stats = generate(rt, chunk, max_new, proposer=proposer, eos_ids=eos, max_len=n)
            assert stats.device_loop
            got.extend(outs)
            if name == "oracle":
                deep += sum(stats.histogram[2:])
        assert got == plain, name
    assert deep > 10, "the oracle's trees were not accepted two levels deep: compaction went unexercised"


def test_tree_decoding_is_lossless_on_ragged_batches(tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9, 4, 11)] + [[7, 8, 9, 10] * 4]
    _check_lossless(rt, hf, prompts, 30, (rt.config.vocab_size - 1, 1880), batch=3)


def test_a_tree_keeps_its_candidates_in_range(tiny_target):
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="total_tokens=40 must be in 1..12"):
        EagleTreeProposer(_random_eagle3(hf), depth=2, top_k=3, total_tokens=40, batch=1, max_len=64)


@pytest.mark.parametrize("kernels", ["off", "force"])
def test_a_draft_is_not_touched_by_what_an_earlier_one_left(tiny_target, kernels):
    """Every draft reuses the proposer's candidate K/V buffer: a draft after one that left inf or
    NaN there (an overflowing drafter) draws the same tree as the draft before it, through the
    torch path (which zeroes the buffer first: slots no node sees meet weight 0 in its product)
    and through the kernels (the tree kernel reads only the slots some query sees; the
    interpreter on a CPU)."""
    dev = kernel_device() if kernels == "force" else "cpu"  # (skips without a Triton backend)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    p = EagleTreeProposer(_random_eagle3(hf).to(dev), depth=3, top_k=3, total_tokens=10, batch=2, max_len=32)
    g = torch.Generator().manual_seed(0)
    p.hidden.copy_(torch.randn(p.hidden.shape, generator=g))
    p.last.copy_(torch.tensor([5, 9]))
    p.k_cache.copy_(torch.randn(p.k_cache.shape, generator=g))
    p.v_cache.copy_(torch.randn(p.v_cache.shape, generator=g))
    with applied(KernelSettings(mode=kernels)):
        want = [t.clone() for t in p.draft_tree()]
        for junk in (float("inf"), float("nan")):
            p.cand_kv.fill_(junk)
            for name, w, o in zip(Tree._fields, want, p.draft_tree()):
                assert torch.equal(o, w), (name, junk)


def test_tree_verify_through_the_kernels_equals_the_torch_path(tiny_target, monkeypatch):
    """float32, every runtime kernel on (the Triton interpreter on a CPU): the tree loop's verify
    step through the RoPE kernel at the tree's slots and the tree-attention kernel (the block read
    from the cache), the selection kernels drafting the tree and the verified tree's bookkeeping
    kernel (kernels/tree_select.py, kernels/tree_accept.py) emit what the torch path emits, with
    the same histograms, and both equal plain greedy decoding; for trees mostly accepted deep down
    (the oracle) and an EAGLE-3 drafter whose trees are accepted too (its draft vocabulary the
    tokens the target answers with): so its loop makes real cache moves inside the next draft's
    rerank and takes in the drafter's next tokens from the bookkeeping kernel."""
    import draftsmith_kernels.tree_attention as tree_attention
    from tests.test_spec_loop import kernel_case
    from tests.test_tree_acceptance import _small_vocab_eagle3

    device, hf, rt, prompts, max_new, eos, n, plain = kernel_case(tiny_target, 16)
    cont = torch.tensor([o + [0] * (max_new - len(o)) for o in plain], device=device)
    drafter = _small_vocab_eagle3(hf, sorted({t for o in plain for t in o} | set(range(4)))).to(device)  # >= top-k
    makers = {"oracle": lambda: OracleTree(cont, width=2, depth=3, vocab=rt.config.vocab_size, seed=1),
              "eagle3": lambda: EagleTreeProposer(drafter, depth=3, top_k=3, total_tokens=10, batch=len(prompts),
                                                  max_len=n, target_config=rt.config)}
    calls = []
    kernel = tree_attention.tree_attention_triton
    monkeypatch.setattr(tree_attention, "tree_attention_triton", lambda *a, **kw: calls.append(a[4]) or kernel(*a, **kw))
    deep = {}
    for name, make in makers.items():
        results = []
        for mode in ("off", "force"):
            calls.clear()
            outs, stats = generate(rt, prompts, max_new, proposer=make(), eos_ids=eos, max_len=n, cuda_graphs=False,
                                   kernels=KernelSettings(mode=mode))
            results.append((outs, stats.row_histograms))
            # through the kernel only when forced: the target's verify with the tree block read
            # from the cache, an EAGLE-3 drafter's tree steps with its candidates apart
            assert (len(calls) > 0) == (mode == "force"), name
            if mode == "force":
                assert any(k is None for k in calls), name
                assert any(k is not None for k in calls) == (name == "eagle3"), name
        assert results[0] == results[1], name
        assert results[0][0] == plain, name
        deep[name] = sum(c for h in results[0][1] for c in h[2:])
    assert all(deep.values()), f"no tree was accepted two levels deep: {deep}"


@pytest.mark.slow
def test_tree_decoding_is_lossless_on_real_prompts_with_the_zoo_target(tokenizer, zoo_plain_greedy):
    """float32, zoo target, 20 real prompts in ragged batches of 5 (plain greedy's outputs, 16
    new tokens in the same batches, from the session's fixture: conftest zoo_plain_greedy): the
    oracle's trees (accepted deep down) and an EAGLE-3 drafter's. Kept nodes expanded into fewer
    children run on the tiny target's ragged batches above (a third pass here took ~30 s of CI)."""
    from models.zoo import resolve_target

    path = resolve_target("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(path, dtype=torch.float32)
    prompts, plain = zoo_plain_greedy
    assert len(prompts) >= 20
    _check_lossless(rt, hf, prompts, 16, (tokenizer.eos_token_id,), batch=5, plain=plain, names=("oracle", "eagle3"))


def test_generate_asks_for_a_graphed_tree_loop_as_for_a_chain(tiny_target, monkeypatch):
    """Draft trees are captured in CUDA graphs wherever chains are, by default: `generate` builds
    the tree loop with graphs unless cuda_graphs=False, and the loop falls back to eager steps
    where graphs cannot run, by the chain's rule (here: a CPU)."""
    import inference.tree.plan as tree_loop

    asked = []

    class Recorded(tree_loop.TreeLoop):
        def __init__(self, *args, graphed, **kwargs):
            asked.append(graphed)
            super().__init__(*args, graphed=graphed, **kwargs)

    monkeypatch.setattr(tree_loop, "TreeLoop", Recorded)
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    prompts = [[5, 6, 7, 8], [3, 4, 3]]
    n = cache_size(prompts, 4, 16)
    proposer = EagleTreeProposer(_random_eagle3(hf), depth=2, top_k=2, total_tokens=4, batch=2, max_len=n,
                                 target_config=rt.config)
    _, stats = generate(rt, prompts, 4, proposer=proposer, max_len=n)
    generate(rt, prompts, 4, proposer=proposer, max_len=n, cuda_graphs=False)
    assert asked == [True, False]
    assert stats.device_loop and not stats.graphed  # a CPU: the same eager fallback as a chain's
    assert all(not loop.graphed for loop in rt._workspace.values() if isinstance(loop, Recorded))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU (the CPU cases run the same loop)")
def test_graphed_tree_loop_equals_the_eager_one_on_a_gpu(tiny_target):
    """float32 on CUDA: the tree step captured in CUDA graphs, as `generate` does by default (the
    loop it builds holds graphs), emits what the eager tree loop (cuda_graphs=False) emits, with
    the same histograms, and both equal plain greedy decoding; the second call replays the
    captured graphs."""
    from inference.tree.plan import TreeLoop
    from tests.test_spec_loop import gpu_case

    from tests.test_tree_acceptance import _small_vocab_eagle3

    hf, rt, prompts, max_new, eos, n, plain = gpu_case(tiny_target, max_new=30, k=16)
    # trees accepted deep down (the draft vocabulary: the tokens the target answers with), so the
    # graphs make real cache moves in the rerank and take in the bookkeeping's next tokens
    drafter = _small_vocab_eagle3(hf, sorted({t for o in plain for t in o} | set(range(4)))).cuda()

    def proposer():
        return EagleTreeProposer(drafter, depth=3, top_k=3, total_tokens=10, batch=len(prompts), max_len=n,
                                 target_config=rt.config)

    eager, eager_stats = generate(rt, prompts, max_new, proposer=proposer(), eos_ids=eos, max_len=n, cuda_graphs=False)
    assert not eager_stats.graphed
    graphed_proposer = proposer()
    for _ in range(2):
        graphed, graphed_stats = generate(rt, prompts, max_new, proposer=graphed_proposer, eos_ids=eos, max_len=n)
        assert graphed == eager == plain
        assert graphed_stats.row_histograms == eager_stats.row_histograms
        assert graphed_stats.graphed
    loops = [v for v in rt._workspace.values() if isinstance(v, TreeLoop) and v.proposer is graphed_proposer]
    assert len(loops) == 1 and loops[0].graphs is not None
    assert sum(c for h in eager_stats.row_histograms for c in h[2:]) > 0  # paths of two nodes and more moved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a GPU (the CPU cases run the same loop)")
def test_graphed_sampled_tree_loop_on_a_gpu(tiny_target):
    """T > 0 on CUDA, float32, the tree step captured in CUDA graphs (one draw from the target per
    node, inside the verify graph): at T = 1e-4 the target's distribution is its argmax, so the
    graphed and the eager loop both emit plain greedy's outputs; at T = 1 both draw from one
    seeded CUDA generator and emit the same tokens (the graphs replay the eager loop's draws),
    every token in the vocabulary, and a second call replays the captured graphs."""
    from tests.test_spec_loop import gpu_case

    hf, rt, prompts, max_new, eos, n, plain = gpu_case(tiny_target, max_new=30, k=16)
    drafter = _random_eagle3(hf).cuda()

    def run(graphed: bool, temperature: float, proposer):
        g = torch.Generator(device="cuda").manual_seed(0)
        return generate(rt, prompts, max_new, proposer=proposer, eos_ids=eos, max_len=n, temperature=temperature,
                        generator=g, cuda_graphs=graphed)

    def proposer():
        return EagleTreeProposer(drafter, depth=3, top_k=3, total_tokens=10, batch=len(prompts), max_len=n,
                                 target_config=rt.config, children=2)

    for temperature in (1e-4, 1.0):
        eager, eager_stats = run(False, temperature, proposer())
        graphed_proposer = proposer()
        for _ in range(2):
            graphed, graphed_stats = run(True, temperature, graphed_proposer)
            assert graphed_stats.device_loop and graphed == eager, temperature
            assert graphed_stats.row_histograms == eager_stats.row_histograms, temperature
            assert all(0 <= t < rt.config.vocab_size for o in graphed for t in o)
        # the graphed runs did replay captured graphs (a generator the graphs could not hold
        # would leave the loop eager, and the comparison empty)
        loops = [v for key, v in rt._workspace.items() if key[0] == "spec" and key[7] == temperature]
        assert any(loop.graphs is not None for loop in loops), temperature
        if temperature < 1e-3:
            assert eager == plain


def test_sampled_tree_decoding_runs_the_tree_loop_and_is_greedy_at_a_tiny_temperature(tiny_target):
    """T > 0: the tree loop matches one draw from the target per node down the tree
    (tests/tree_reference.py: sampled_tree_verify, its chi-square test). At T = 1e-4 the target's distribution is its
    argmax, so the oracle's trees (plain greedy's continuation among the candidates) give plain
    greedy's outputs, accepted two levels deep and more; a random EAGLE-3 tree at T = 1 runs."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rt = RuntimeModel.from_pretrained(tiny_target)
    torch.manual_seed(3)
    prompts = [torch.randint(0, 40000, (n,)).tolist() for n in (6, 13, 9)]
    eos, max_new = (rt.config.vocab_size - 1,), 20
    n = cache_size(prompts, max_new, 16)
    plain, _ = generate(rt, prompts, max_new, eos_ids=eos, max_len=n)
    width = max(len(o) for o in plain)
    cont = torch.tensor([o + [0] * (width - len(o)) for o in plain])
    g = torch.Generator().manual_seed(0)
    outs, stats = generate(rt, prompts, max_new, proposer=OracleTree(cont, width=2, depth=3, vocab=rt.config.vocab_size, seed=0),
                           eos_ids=eos, max_len=n, temperature=1e-4, generator=g)
    assert stats.device_loop and outs == plain
    assert sum(stats.histogram[2:]) > 5
    proposer = EagleTreeProposer(_random_eagle3(hf), depth=3, top_k=3, total_tokens=10, batch=3, max_len=n,
                                 target_config=rt.config)
    outs, stats = generate(rt, prompts, max_new, proposer=proposer, eos_ids=eos, max_len=n, temperature=1.0, generator=g)
    assert all(len(o) == max_new or (0 < len(o) < max_new and o[-1] in eos) for o in outs)
    assert all(0 <= t < rt.config.vocab_size for o in outs for t in o) and stats.steps > 0
    with pytest.raises(ValueError, match="standard verification"):
        generate(rt, prompts, max_new, proposer=proposer, eos_ids=eos, max_len=n, temperature=1.0, verification="block")
