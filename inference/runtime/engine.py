"""`generate`: the runtime's one entry point for decoding. It sizes the KV cache, runs the
prefill (inference/runtime/steps.py) and hands the rest to one of three loops:

- plain greedy decoding, feeding its own argmax back on the device (inference/runtime/steps.py);
- the device loop, for proposers that draft from device tensors (inference/runtime/spec_loop.py);
- the host loop, for proposers that draft on the host (inference/runtime/host_loop.py).

Greedy verification is lossless: every emitted token is the target's argmax given the tokens
before it, so the output equals plain greedy decoding (exactly, in float32).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from inference.walks.greedy import acceptance_from_histogram
from inference.proposers.base import capabilities
from inference.runtime.graphs import reuse
from inference.runtime.host_loop import host_speculation
from inference.runtime.model import RuntimeModel
from inference.runtime.spec_loop import device_speculation
from inference.runtime.steps import GreedyDecodeStep, plain_greedy, prefill  # noqa: F401  (GreedyDecodeStep: scripts/profile_decode.py)
from inference.runtime.verify import sampling_probs
from draftsmith_kernels.settings import KernelSettings, applied


@dataclass
class GenerationStats:
    k: int
    steps: int = 0  # target forwards after prefill
    new_tokens: int = 0
    histogram: list[int] = field(default_factory=list)  # accepted-length counts 0..k per drafted row-step
    row_histograms: list[list[int]] = field(default_factory=list)  # the same per row (histogram: their sum)
    draft_seconds: float = 0.0  # the proposer's work (device time in the device loop: advance and draft)
    verify_seconds: float = 0.0  # the target's verify forward, acceptance and emission
    total_seconds: float = 0.0
    host_syncs: int = 0  # times the host waited for the device's results
    verify_tokens: int | None = None  # drafted tokens verified per step, when not k (a tree's nodes)
    device_loop: bool = False  # drafted and verified by the device loop (inference/runtime/spec_loop.py)
    graphed: bool = False  # the decode / verify steps replayed CUDA graphs (chains and trees alike, where they can)
    # what the device loop's "other" time holds: the setup before the first step (prefill,
    # first token, the proposer's begin; synced), and the host's time launching the steps (when
    # it exceeds the device's, the GPU waits on the host)
    setup_seconds: float = 0.0
    launch_seconds: float = 0.0
    launched_steps: int = 0  # steps the device loop ran, warm-up and steps past every row's end included
    verified_drafts: int | None = None  # drafts the target verified, over every row-step (adaptive verification)

    def summary(self) -> dict:
        other = self.total_seconds - self.draft_seconds - self.verify_seconds
        per_step = (lambda s: round(1e3 * s / self.steps, 4)) if self.steps else (lambda s: None)
        out = {"k": self.k, "steps": self.steps, "new_tokens": self.new_tokens,
               "tokens_per_s": self.new_tokens / self.total_seconds if self.total_seconds else None,
               "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4),
               "other_seconds": round(other, 4),
               "draft_ms_per_step": per_step(self.draft_seconds), "verify_ms_per_step": per_step(self.verify_seconds),
               "other_ms_per_step": per_step(other),
               "host_launch_ms_per_step": per_step(self.launch_seconds), "setup_seconds": round(self.setup_seconds, 4),
               "host_syncs": self.host_syncs, "launched_steps": self.launched_steps,
               "host_syncs_per_token": round(self.host_syncs / self.new_tokens, 4) if self.new_tokens else None,
               "device_loop": self.device_loop, "graphed": self.graphed}
        if self.k:
            out["acceptance"] = acceptance_from_histogram(self.histogram)
        if self.verified_drafts is not None:  # adaptive verification: the mean width it chose
            row_steps = sum(self.histogram)
            out["verified_drafts_per_row_step"] = round(self.verified_drafts / row_steps, 4) if row_steps else None
        return out

    def prometheus(self, prefix: str = "draftsmith_spec_decode") -> str:
        """Counters in Prometheus' text exposition format: drafts (row-steps that drafted),
        draft tokens, accepted tokens, and accepted tokens per draft position."""
        drafts = sum(self.histogram)
        accepted = sum(n * c for n, c in enumerate(self.histogram))
        at_least = [sum(self.histogram[i:]) for i in range(1, self.k + 1)]  # position i accepted
        lines = []
        for name, help_text, value in (
            ("num_drafts", "Row-steps that verified drafts.", drafts),
            ("num_draft_tokens", "Draft tokens proposed and verified.", drafts * self.k),
            ("num_accepted_tokens", "Draft tokens accepted.", accepted),
            ("num_emitted_tokens", "Tokens emitted (accepted drafts and target tokens).", self.new_tokens),
        ):
            lines += [f"# HELP {prefix}_{name}_total {help_text}", f"# TYPE {prefix}_{name}_total counter",
                      f"{prefix}_{name}_total {value}"]
        lines += [f"# HELP {prefix}_num_accepted_tokens_per_pos_total Accepted drafts by position (1-based).",
                  f"# TYPE {prefix}_num_accepted_tokens_per_pos_total counter"]
        lines += [f'{prefix}_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}' for i, n in enumerate(at_least, 1)]
        return "\n".join(lines) + "\n"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: RuntimeModel, prompts: list[list[int]], max_new_tokens: int, proposer=None,
             eos_ids: tuple[int, ...] = (), max_len: int | None = None,
             cuda_graphs: bool = True, temperature: float = 0.0,
             generator: torch.Generator | None = None,
             k_table: list[list[int]] | None = None,
             fast_plain: bool = True, top_k: int = 0, top_p: float = 1.0,
             verification: str = "standard", device_loop: bool = True,
             kernels: KernelSettings | None = None, adaptive=None) -> tuple[list[list[int]], GenerationStats]:
    """Greedy decoding of a ragged batch; with a proposer, `proposer.k` drafts per row and step.

    Every kernel of the generation (the model's, the proposer's, the loop's) follows `kernels`,
    the model's own settings by default (`model.kernels`, kernels/settings.py): this is where
    they are applied, for the call's length.

    `max_len` is the KV cache size; proposers that keep their own cache must be built with
    the same size (`cache_size` gives it). On a GPU the decode/verify step (fixed shape
    [B, k+1]) runs as a CUDA graph unless cuda_graphs=False.

    temperature > 0 samples from softmax(logits / temperature), restricted by top_k / top_p,
    and verifies drafts by `verification`: "standard" rejection sampling or "block"
    verification (drafts taken as certain, q = 1), both reproducing that distribution; or
    "synthetic:RATE", benchmarks only: each draft accepted with probability RATE.

    k_table [[min_bs, max_bs, k], ...] picks the draft length by batch size (k = 0 turns
    drafting off: large batches are compute-bound and gain little from speculation).

    Plain greedy decoding (no proposer, temperature 0) takes a device-side loop unless
    fast_plain=False: each step feeds its own argmax back, and the host checks for
    end-of-sequence once every `steps.EOS_CHECK_EVERY` tokens instead of syncing per token.

    A device proposer (`on_device`, inference/proposers/model_free.py) runs in the device loop of
    inference/runtime/spec_loop.py unless device_loop=False: drafts, acceptance and emitted tokens stay
    on the device, each step is captured in CUDA graphs on a GPU, and the host looks at the
    done flags once every few steps. Other proposers (suffix decoding, the host n-gram, drafting
    across vocabularies) run in the host loop below, which reads every step's result.

    `adaptive` (inference/runtime/adaptive.py AdaptiveVerification; None: k drafts every step)
    verifies, per step of the device loop, the width the drafts' confidences and the measured
    step-cost table make fastest; a proposer with a confidence head only (DSpark)."""
    with applied(kernels or model.kernels):
        return _generate(model, prompts, max_new_tokens, proposer, eos_ids, max_len, cuda_graphs, temperature,
                         generator, k_table, fast_plain, top_k, top_p, verification, device_loop, adaptive)


def _generate(model, prompts, max_new_tokens, proposer, eos_ids, max_len, cuda_graphs, temperature, generator, k_table,
              fast_plain, top_k, top_p, verification, device_loop, adaptive=None):
    k = proposer.k if proposer is not None else 0
    if k_table is not None and proposer is not None:
        k = draft_length(k_table, len(prompts), proposer.k)
        if k == 0:
            proposer = None
    caps = capabilities(proposer)  # what it declares, checked once (inference/proposers/base.py)
    aux_layers = caps.aux_layers
    if adaptive is not None and not (proposer is not None and device_loop and caps.on_device and k == proposer.k):
        raise ValueError("adaptive verification runs in the device loop: it needs a device proposer drafting its own k")
    device = model.embed_tokens.weight.device
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    need = cache_size(prompts, max_new_tokens, (k if caps.verify_tokens is None else caps.verify_tokens))  # a tree verifies more
    max_len = max_len or -(-need // CACHE_BUCKET) * CACHE_BUCKET  # few distinct sizes: graphs get reused
    if need > max_len:
        raise ValueError(f"prompt of {max(lengths)} tokens + {max_new_tokens} new + {k + 1} verify slots exceeds the cache of {max_len}")
    stats = GenerationStats(k=k, histogram=[0] * (k + 1), row_histograms=[[0] * (k + 1) for _ in prompts])
    t_start = time.perf_counter()
    cache = reuse(model, ("cache", B, max_len), lambda: model.new_cache(B, max_len))

    graphed = cuda_graphs and device.type == "cuda" and getattr(model, "graphable", True)
    stats.graphed = graphed  # (the device loop says for itself: spec_loop.device_speculation)
    with record_function("draftsmith.prefill"):  # named ranges: a profiler trace shows where a generation goes
        logits, aux = prefill(model, cache, prompts, aux_layers, graphed)
    if verification not in ("standard", "block") and not verification.startswith("synthetic:"):
        raise ValueError(f"verification {verification!r} is not one of standard, block, synthetic:RATE")
    with record_function("draftsmith.first_token"):
        if temperature > 0:
            first = torch.multinomial(sampling_probs(logits[:, 0], temperature, top_k, top_p), 1, generator=generator)[:, 0]
        else:
            first = logits[:, 0].argmax(-1)  # [B]
    if proposer is None and temperature == 0 and fast_plain:  # stays on the device: no read of the first tokens
        with record_function("draftsmith.plain_loop"):
            outputs, stats.host_syncs = plain_greedy(model, cache, first, torch.as_tensor(lengths, device=device),
                                                      max_new_tokens, eos_ids, graphed=graphed)
        _sync(device)
        stats.total_seconds = time.perf_counter() - t_start
        stats.verify_seconds = stats.total_seconds
        stats.new_tokens = sum(len(o) for o in outputs)
        stats.steps = max(len(o) for o in outputs) - 1
        return outputs, stats
    if proposer is not None and device_loop and caps.on_device and k == proposer.k:
        # the first tokens stay on the device (no host sync before the proposer begins)
        outputs = device_speculation(model, cache, proposer, prompts, aux, first, max_new_tokens, eos_ids, max_len, stats,
                                      cuda_graphs, temperature, top_k, top_p, verification, generator, t_start,
                                      adaptive=adaptive)
        _sync(device)
        stats.total_seconds = time.perf_counter() - t_start
        stats.new_tokens = sum(len(o) for o in outputs)
        return outputs, stats
    nxt = first.tolist()  # the host loop's proposers begin from the host's copy of each row's first token
    with record_function("draftsmith.host_loop"):
        outputs = host_speculation(model, cache, proposer, prompts, aux, nxt, k, max_new_tokens, eos_ids, stats, cuda_graphs,
                                   temperature, top_k, top_p, verification, generator)
    _sync(device)
    stats.total_seconds = time.perf_counter() - t_start
    stats.new_tokens = sum(len(o) for o in outputs)
    return outputs, stats


CACHE_BUCKET = 256  # cache lengths are rounded up to this


def cache_size(prompts: list[list[int]], max_new_tokens: int, k: int) -> int:
    """KV positions a generation needs: longest prompt + new tokens + one verify window."""
    return max(len(p) for p in prompts) + max_new_tokens + k + 1


def draft_length(k_table: list[list[int]], batch: int, capability: int) -> int:
    """k for this batch size from [[min_bs, max_bs, k], ...]; the proposer's own k when no row
    covers the batch. A k beyond what the proposer drafts is an error, not a silent cap."""
    for row in k_table:
        if len(row) != 3 or min(row) < 0 or row[0] > row[1]:
            raise ValueError(f"k table row {row} must be [min_bs, max_bs, k] with 0 <= min_bs <= max_bs, k >= 0")
    for lo, hi, k in k_table:
        if lo <= batch <= hi:
            if k > capability:
                raise ValueError(f"k table asks for k={k} at batch {batch}, beyond the proposer's {capability}")
            return k
    return capability
