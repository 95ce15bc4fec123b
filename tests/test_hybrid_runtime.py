"""A hybrid target (transformers' Bamba: Mamba2 layers beside attention) in the runtime
(inference/runtime/hybrid.py): logits equal transformers' in float32, the recurrent state rolled
back per row after a partly accepted verify, and greedy speculative decoding equal to plain greedy
on a ragged batch with every chain proposer."""
import pytest
import torch

from inference.runtime.engine import generate
from inference.runtime.model import RuntimeModel

V = 96


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    """A tiny random Bamba (layers mamba, attention, mamba, mamba; 2 SSM groups, partial RoPE),
    its A_log, dt_bias, D and norms moved off their initial values so each one counts."""
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8, mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=8, mamba_n_groups=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.5  # bamba's default: a partial RoPE
    torch.manual_seed(0)
    hf = BambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("bamba")
    hf.save_pretrained(folder)
    return hf, RuntimeModel.from_pretrained(folder, dtype=torch.float32)


def test_hybrid_logits_equal_transformers_through_prefill_verify_and_rollback(bamba):
    """Ragged right-padded prefill (rows of 5 and 9 tokens), then a verify of 4 tokens per row, then
    the next step from where each row's acceptance left it (row 0 kept 1 of 3 drafts, row 1 all 3):
    every logit equal to transformers' forward over the same tokens within 1e-4."""
    hf, rt = bamba
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, V, (2, 20), generator=g)
    lengths = [5, 9]
    with torch.no_grad():
        out = hf(seq, output_hidden_states=True)
        want = out.logits
        logits, aux = rt(seq, torch.arange(20).expand(2, 20), rt.new_cache(2, 64), aux_layers=(0, 2))
        assert (logits - want).abs().max() < 1e-4
        # EAGLE-3's aux features: the hidden states after a mamba layer and after the attention one
        ref = torch.cat([out.hidden_states[1], out.hidden_states[3]], -1)
        assert (aux - ref).abs().max() < 1e-4
        cache = rt.new_cache(2, 64)
        padded = seq[:, :9].clone()
        padded[0, 5:] = 0
        last = torch.tensor(lengths) - 1
        logits, _ = rt(padded, torch.arange(9).expand(2, 9), cache, logits_at=last, causal_prefill=True)
        for b, n in enumerate(lengths):
            assert (logits[b, 0] - want[b, n - 1]).abs().max() < 1e-4
        start = torch.tensor(lengths)
        fed = torch.stack([seq[b, n: n + 4] for b, n in enumerate(lengths)])
        logits, _ = rt(fed, start[:, None] + torch.arange(4), cache)
        for b, n in enumerate(lengths):
            assert (logits[b] - want[b, n: n + 4]).abs().max() < 1e-4
        accepted = torch.tensor([1, 3])
        start = start + accepted + 1  # the bonus's position: the state must be the one after start - 1
        fed = torch.stack([seq[b, int(s): int(s) + 4] for b, s in enumerate(start)])
        logits, _ = rt(fed, start[:, None] + torch.arange(4), cache)
        for b, s in enumerate(start.tolist()):
            assert (logits[b] - want[b, s: s + 4]).abs().max() < 1e-4
        with pytest.raises(ValueError, match="hybrid target .*bamba.* draft trees"):
            rt(fed, start[:, None] + torch.arange(4), cache, tree_mask=torch.ones(2, 3, 3, dtype=torch.bool))


def test_hybrid_cache_keeps_the_last_slots_and_restores_for_a_capture(bamba):
    """A forward longer than the history's slots keeps its last ones (a later step rolls back into
    them exactly); the clone / copy_ a graph capture's restore calls puts the recurrent state,
    history and K/V back, so a step rerun after it computes what it computed the first time."""
    from inference.runtime.hybrid import HybridCache

    hf, rt = bamba
    seq = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(seq).logits
        cache = HybridCache(rt.config, 2, 32, torch.float32, "cpu", slots=3)
        rt(seq[:, :10], torch.arange(10).expand(2, 10), cache)  # keeps the states after positions 7, 8, 9
        start = torch.tensor([8, 10])  # row 0 rolls back to after position 7, row 1 continues after 9
        fed = torch.stack([seq[b, s: s + 4] for b, s in enumerate(start.tolist())])
        saved_k, saved_v = cache.k.clone(), cache.v.clone()
        first, _ = rt(fed, start[:, None] + torch.arange(4), cache)
        for b, s in enumerate(start.tolist()):
            assert (first[b] - want[b, s: s + 4]).abs().max() < 1e-4
        cache.k.copy_(saved_k)
        cache.v.copy_(saved_v)
        again, _ = rt(fed, start[:, None] + torch.arange(4), cache)
    assert torch.equal(first, again)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_hybrid_graphed_steps_equal_eager(bamba):
    """On a GPU: a hybrid target's captured steps (prefill, plain decoding, the host loop's verify,
    the device loop with EAGLE-3) give the eager steps' tokens. graphable is turned on for this
    model only: hybrid.py keeps it off until this passes."""
    from inference.proposers import drafter_proposer

    hf, rt = bamba
    prompts = _prompts()
    n = max(len(p) for p in prompts) + 14 + 4
    eagle3 = _drafters(hf.config)["eagle3"].cuda()
    runs = []
    rt.cuda()  # (the fixture's model: moved back below)
    try:
        for graphable in (False, True):
            rt.graphable = graphable
            plain, _ = generate(rt, prompts, 14)
            spoiled, _ = generate(rt, prompts, 14, proposer=Spoiling(prompts, plain, k=3))
            device, _ = generate(rt, prompts, 14, proposer=drafter_proposer(eagle3, 3, len(prompts), n, rt.config),
                                 max_len=n)
            runs.append((plain, spoiled, device))
    finally:
        rt.graphable = False
        rt.cpu()
    assert runs[0] == runs[1]
    assert runs[0][1] == runs[0][0] and runs[0][2] == runs[0][0]


def test_training_reads_a_hybrid_targets_aux_features_as_the_runtime_serves_them(bamba):
    """EAGLE-3 training's Target (models/target.py, transformers' model with hooks) gives a hybrid
    target's aux features (a mamba layer's, an attention layer's) equal to the runtime's."""
    from models.target import Target

    hf, rt = bamba
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        target = Target(hf, [0, 1]).eval()
        trained = target(ids).aux
        trained_with_mask = target(ids, attention_mask=torch.ones_like(ids)).aux
        served = rt(ids, torch.arange(11).expand(2, 11), rt.new_cache(2, 32), aux_layers=(0, 1))[1]
    assert trained.shape == served.shape == (2, 11, 64)
    assert (trained - served).abs().max() < 1e-4
    assert (trained_with_mask - served).abs().max() < 1e-4


def _prompts():
    """Ragged prompts that repeat themselves, so n-gram drafts are partly accepted (a rollback
    of some but not all drafts in most steps)."""
    g = torch.Generator().manual_seed(2)
    out = []
    for n in (7, 12, 4):
        motif = torch.randint(3, V, (n,), generator=g).tolist()
        out.append((motif * 3)[: 2 * n + 3])
    return out


class Spoiling:
    """A host proposer that knows plain greedy's output and drafts it with one token spoiled,
    at draft index (row + step) % (k + 1) (k + 1: none spoiled): every row of a ragged batch
    accepts 0..k drafts in turn, each in a different step from the others."""

    aux_layers = ()

    def __init__(self, prompts, outputs, k):
        self.truth = [p + o for p, o in zip(prompts, outputs)]
        self.k, self.step = k, 0

    def begin(self, prompts, aux, first):
        self.step = 0

    def propose(self, tokens):
        drafts = []
        for b, t in enumerate(tokens):
            d = self.truth[b][len(t): len(t) + self.k]
            spoil = (b + self.step) % (self.k + 1)
            if spoil < len(d):
                d[spoil] = (d[spoil] + 1) % V
            drafts.append(d)
        self.step += 1
        return drafts

    def accepted(self, fed, aux, counts, active):
        pass


def _drafters(hf_cfg):
    from models.dflash import DFlashConfig, DFlashDrafter
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.medusa import MedusaConfig, MedusaDrafter
    from models.mtp import MTPConfig, MTPDrafter

    torch.manual_seed(0)
    drafters = {
        "eagle3": Eagle3Drafter(Eagle3Config.from_target(hf_cfg, V)),
        "medusa": MedusaDrafter(MedusaConfig.from_target(hf_cfg, V, 3)),
        "mtp": MTPDrafter(MTPConfig.from_target(hf_cfg, V, 3)),
        "dflash": DFlashDrafter(DFlashConfig.from_target(hf_cfg, V, 0, num_layers=1, block_size=4)),
    }
    for d in drafters.values():
        for _, p in d.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.1)
        d.eval()
    return drafters


def test_hybrid_greedy_speculative_equals_plain_greedy(bamba):
    """float32, 3 ragged prompts in one batch, 14 new tokens: the n-gram proposer and a proposer
    spoiling one draft of plain greedy's continuation (host loop: rows roll back by 0..k drafts,
    each row by a different count in a step) and the random EAGLE-3, Medusa, MTP and DFlash
    drafters and the device n-gram proposer (the device loop) give plain greedy's tokens."""
    from inference.proposers import GpuNgramProposer, NgramProposer, drafter_proposer

    hf, rt = bamba
    prompts = _prompts()
    plain, _ = generate(rt, prompts, 14)
    with torch.no_grad():  # the runtime's plain greedy is transformers' greedy: each token its argmax
        for p, o in zip(prompts, plain):
            logits = hf(torch.tensor([p + o])).logits[0, len(p) - 1: -1]
            assert logits.argmax(-1).tolist() == o
    assert generate(rt, prompts, 14, proposer=NgramProposer(k=3, max_n=3))[0] == plain
    out, stats = generate(rt, prompts, 14, proposer=Spoiling(prompts, plain, k=3))
    assert out == plain
    for hist in stats.row_histograms:  # every row rolled back by 0, 1, 2 drafts and kept all 3
        assert all(hist), stats.row_histograms
    n = max(len(p) for p in prompts) + 14 + 4
    makers = {name: (lambda d=d: drafter_proposer(d, 3, len(prompts), n, rt.config))
              for name, d in _drafters(hf.config).items()}
    makers["ngram-gpu"] = lambda: GpuNgramProposer(3, len(prompts), n, max_n=3)
    for name, make in makers.items():
        got, _ = generate(rt, prompts, 14, proposer=make(), max_len=n)
        assert got == plain, name


def test_hybrid_speculation_through_the_kernels_equals_plain_greedy(bamba):
    """The same with every kernel forced (the rollback's Triton kernel among them; on a CPU through
    TRITON_INTERPRET=1): the partly-accepting proposer's output equals plain greedy's."""
    from draftsmith_kernels.settings import KernelSettings
    from tests.conftest import kernel_device

    kernel_device()  # skips without CUDA or the interpreter
    _, rt = bamba
    prompts = _prompts()
    plain, _ = generate(rt, prompts, 8)
    rt.kernels = KernelSettings(mode="force")
    try:
        out, stats = generate(rt, prompts, 8, proposer=Spoiling(prompts, plain, k=3))
    finally:
        rt.kernels = KernelSettings()
    assert out == plain
    assert sum(sum(h[1:3]) for h in stats.row_histograms) > 0  # partial acceptances rolled back
