"""The speculative loop on the device: draft → verify → accept → advance, from device tensors.

Every per-step value (drafts, accepted lengths, bonus tokens, positions, per-row done flags,
the emitted tokens) stays on the device, so the host only launches steps. On a GPU each step
is two CUDA-graph replays (the target's verify step; the proposer's advance and next draft;
one shared memory pool) and the host reads the done flags once every `check_every` steps; on a
CPU the same functions run eagerly.

Shapes: B rows, S token/cache slots per row, k drafts per step, V vocabulary, W aux width.
Row b holds tokens[b, :length[b]] (prompt + emitted); the verify step feeds its last token and
k drafts at positions length-1 .. length-1+k. Finished rows keep their length, so their later
(ignored) steps write only at positions the row owns, inside its cache.
A hybrid target's recurrent layers follow the same positions: the verify forward's first launch
sets each row's state to the one after position length-2, kept by the previous forward
(kernels/state_rollback.py; inference/runtime/hybrid.py), so rejected drafts leave no trace.

Adaptive verification (inference/runtime/adaptive.py; a proposer with confidences): each draft
also chooses, on the device, the width w in 1..k its drafts are worth verifying; the verify step
then feeds w + 1 tokens per row (one verify graph per width). The host launches the width it last
read: on a CPU the current one (it reads every step), on a GPU the one chosen at the last step of
the previous group, copied with the rows' remaining budget (no extra sync). Any width is
lossless at T = 0; sampled drafts take a width whose choice to verify draft j never reads draft j
(adaptive.choose_width, causal), so verification still reproduces the target's distribution.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from inference.runtime.adaptive import choose_width, step_ms_tensor
from inference.runtime.graphs import capture_graph, graph_generator_ok, kernel_settings, reuse
from inference.proposers.base import capabilities
from inference.runtime.verify import block_verify, greedy_verify, rejection_verify, sampling_probs, synthetic_verify
from draftsmith_kernels.emit import EmitState, emit, feed


class SpecLoop:
    """Static buffers and (on a GPU) captured graphs of one (model cache, proposer, B, S, k,
    sampling) combination, reused by every `generate` call of that shape."""

    def __init__(self, model, cache, proposer, batch: int, max_len: int, k: int, eos_ids, temperature: float,
                 top_k: int, top_p: float, verification: str, generator, graphed: bool, adaptive=None):
        dev = model.embed_tokens.weight.device
        self.model, self.cache, self.proposer, self.k = model, cache, proposer, k
        self.caps = capabilities(proposer)  # what it declares, checked once per loop (inference/proposers/base.py)
        self.aux_layers = self.caps.aux_layers
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.verification, self.generator = verification, generator
        self.sampled = temperature > 0 and not verification.startswith("synthetic:") and self.caps.draft_sampled
        self.tokens = torch.zeros(batch, max_len, dtype=torch.long, device=dev)
        self.length = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens held per row
        self.n_out = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens emitted per row
        self.budget = torch.zeros(1, dtype=torch.long, device=dev)  # max_new_tokens (a tensor: graphs stay reusable)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.active = torch.ones(batch, dtype=torch.bool, device=dev)  # ~done, kept by `emit` (no launch of its own)
        self.histogram = torch.zeros(batch, k + 1, dtype=torch.long, device=dev)  # accepted-length counts per row
        self.row_steps = torch.zeros(batch, dtype=torch.long, device=dev)  # steps each row took part in
        self.eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.fed_ids = torch.zeros(batch, k + 1, dtype=torch.long, device=dev)  # the verify step's input
        self.fed_positions = torch.zeros(batch, k + 1, dtype=torch.long, device=dev)
        self.graphed = graphed and dev.type == "cuda" and getattr(model, "graphable", True) and graph_generator_ok(generator)
        self.verified = torch.zeros(batch, dtype=torch.long, device=dev)  # drafts verified per row, over its steps
        # adaptive verification: the step's cost by width [k+1] and the width the last draft chose
        self.adaptive = adaptive
        self.step_ms = None if adaptive is None else step_ms_tensor(adaptive.costs, batch, k, dev)
        self.chosen = torch.full((), k, dtype=torch.long, device=dev)
        self.width = k  # the width the host launches (read from `chosen`)
        self.aux_full = None  # [B,k+1,W]: a step's aux, padded for the proposer's advance (adaptive)
        self.accepted_out = torch.zeros(batch, dtype=torch.long, device=dev)  # a step's accepted [B] (adaptive)
        self.bonus_out = torch.zeros(batch, dtype=torch.long, device=dev)  # and its bonus tokens [B]
        self.graphs = None
        self.state_ids = None  # the proposer's state tensors the graphs were captured with

    # ------------------------------------------------------------------ one step, three phases
    def draft_phase(self):
        if self.sampled:
            self.drafts, self.q = self.proposer.draft_sampled(self.temperature, self.generator)
        else:
            self.drafts, self.q = self.proposer.draft(), None
        if self.adaptive is not None:  # the width worth verifying, from the drafts' confidences [B,k]
            # sampled drafts: the causal rule (verifying draft j never depends on draft j itself)
            self.chosen.copy_(choose_width(self.proposer.confidence, self.active, self.step_ms, causal=self.temperature > 0))

    def verify_phase(self, width: int | None = None):
        """One verify step of `width` drafts per row (default k): the first `width` drafts of
        each row are fed and verified, the rest never reach the target."""
        w = self.k if width is None else width
        drafts, q = self.drafts[:, :w], (None if self.q is None else self.q[:, :w])  # [B,w], [B,w,V]
        if w == self.k:
            fed, positions = self.fed_ids, self.fed_positions  # [B,k+1]
        else:  # contiguous inputs of the narrower step, one pair per width
            fed, positions = self._narrow_inputs(w)
        feed(self.tokens, self.length, drafts, fed, positions)
        logits, aux = self.model(fed, positions, self.cache, self.aux_layers)
        if self.verification.startswith("synthetic:"):
            accepted, bonus = synthetic_verify(drafts, float(self.verification.split(":", 1)[1]), logits, self.generator)
        elif self.temperature > 0:
            verify = block_verify if self.verification == "block" else rejection_verify
            probs = sampling_probs(logits, self.temperature, self.top_k, self.top_p)
            accepted, bonus = verify(drafts, q, probs, self.generator)
        else:
            accepted, bonus = greedy_verify(drafts, logits)
        if self.adaptive is not None:  # the widths it chose (fixed k: k per row-step, no launch spent)
            self.verified.add_(self.active.long(), alpha=w)  # (before emit updates `active`)
        self.emit(drafts, accepted, bonus)
        if self.adaptive is not None:
            # every width's graph hands the proposer's graph (captured once, after them all) the same
            # static buffers, k+1 columns wide: the advance masks the columns past w (j > accepted)
            if w < self.k:
                self.fed_ids[:, : w + 1].copy_(fed)
                fed = self.fed_ids
            if aux is not None:
                if self.aux_full is None or self.aux_full.shape[-1] != aux.shape[-1]:
                    self.aux_full = aux.new_zeros(aux.shape[0], self.k + 1, aux.shape[-1])
                self.aux_full[:, : w + 1].copy_(aux)
                aux = self.aux_full
            accepted, bonus = self.accepted_out.copy_(accepted), self.bonus_out.copy_(bonus)
        self.fed, self.aux, self.accepted, self.bonus = fed, aux, accepted, bonus

    def _narrow_inputs(self, w: int):
        """The verify step's input buffers for width w < k: fed and positions [B,w+1]."""
        inputs = self.__dict__.setdefault("_narrow", {})
        if w not in inputs:
            inputs[w] = (self.fed_ids[:, : w + 1].clone(), self.fed_positions[:, : w + 1].clone())
        return inputs[w]

    def widths(self) -> tuple[int, ...]:
        """The verify widths this loop launches: 1..k with adaptive verification, else k."""
        return tuple(range(1, self.k + 1)) if self.adaptive is not None else (self.k,)

    def _verify_at(self, w: int):
        """The verify phase of width w as a call without arguments (a tree loop's has none)."""
        return self.verify_phase if self.adaptive is None else (lambda: self.verify_phase(w))

    def emit(self, drafts, accepted, bonus):
        """The accepted drafts [B,k] (the first `accepted` of each row), then the bonus, into
        each row's tokens; cut after an end-of-sequence token and at the row's budget; none for
        finished rows. Updates lengths, done flags (and `active`, their negation, which the
        proposer's advance reads) and the accepted-length histogram (one launch on a GPU:
        kernels/emit.py)."""
        emit(drafts, accepted, bonus, *self.emit_state)

    @property
    def emit_state(self) -> EmitState:
        """What `emit` updates (the tree's bookkeeping kernel emits into it too)."""
        return EmitState(self.eos, self.budget, self.tokens, self.length, self.n_out, self.done, self.histogram,
                         self.row_steps, self.active)

    def advance_phase(self):
        # after the step: a row that has just finished keeps its proposer state in place
        self.proposer.advance(self.fed, self.aux, self.accepted, self.bonus, self.active)

    def proposer_phase(self):
        """The proposer's part of a step: take in the last step's verified tokens, then draft
        the next chain (one graph: advance and draft share their launches)."""
        self.advance_phase()
        self.draft_phase()

    def _warmup_widths(self) -> list[int]:
        """The widths of the real steps that warm the loop up before capture: every verify width
        once, and at least two steps."""
        widths = list(self.widths())
        return (widths * 2)[: max(2, len(widths))]

    def _capture(self):
        """A first draft and real steps (`_warmup_widths`) run eagerly on a side stream (warm-up:
        the loop is left holding fresh drafts), then the graphs are captured into one memory pool:
        the first draft, the verify step of each width, and the proposer's step (advance, then
        draft)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            self.draft_phase()
            for w in self._warmup_widths():
                self._verify_at(w)()
                self.proposer_phase()
        torch.cuda.current_stream().wait_stream(stream)
        generator = self.generator if self.sampled else None
        first_draft = capture_graph(self.draft_phase, warmup=0, generator=generator)
        graphs = {"draft": first_draft}
        for w in self.widths():
            graphs[("verify", w)] = capture_graph(self._verify_at(w), warmup=0, pool=first_draft.pool(),
                                                  generator=self.generator)
        graphs["proposer"] = capture_graph(self.proposer_phase, warmup=0, pool=first_draft.pool(), generator=generator)
        self.graphs = graphs
        self.state_ids = _state_ids(self.proposer)

    # ------------------------------------------------------------------ a whole generation
    def reset(self, prompts: list[list[int]], first: torch.Tensor, max_new_tokens: int):
        """Prompts and each row's first token (from the prefill) into the buffers."""
        B, dev = len(prompts), self.tokens.device
        pin = dev.type == "cuda"  # pinned: the copies are queued behind the prefill, no host sync
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, pin_memory=pin).to(dev, non_blocking=pin)
        padded = torch.zeros(B, max(len(p) for p in prompts), dtype=torch.long, pin_memory=pin)
        for b, p in enumerate(prompts):
            padded[b, : len(p)] = torch.as_tensor(p)
        self.tokens.zero_()
        self.tokens[:, : padded.shape[1]].copy_(padded, non_blocking=pin)
        self.tokens.scatter_(1, lengths[:, None], first[:, None])
        self.length.copy_(lengths + 1)
        self.n_out.fill_(1)
        self.budget.fill_(max_new_tokens)
        self.done.copy_((first[:, None] == self.eos).any(-1) | (max_new_tokens <= 1))
        torch.logical_not(self.done, out=self.active)
        self.histogram.zero_()
        self.row_steps.zero_()
        self.verified.zero_()

    def run(self, max_steps: int, check_every: int) -> dict:
        """Steps until every row is done: a first draft, then per step the verify graph and the
        proposer's graph, two replays, launched in groups of up to `check_every` steps. Returns
        the device time of the proposer's work (advance and draft) and of the verify steps (CUDA
        events on a GPU, the host clock on a CPU), the host's time launching them, the steps
        launched and the host syncs.

        How many steps a group launches: a step emits at most k + 1 tokens per row, so a row with
        r tokens left needs at least ceil(r / (k + 1)) more steps; launching no more than that
        never runs a step after every row has reached its budget (the first call of a shape also
        runs the capture's two warm-up steps, whatever the budget). On a GPU the host learns r
        without leaving the GPU idle: right after a group's last verification (which emits) the
        loop copies r to the host (pinned memory, an event) and queues the last step's proposer
        phase behind the copy; the host waits for the copy while that phase runs and launches the
        next group behind it, or stops at r = 0 (the GPU waits only when the host takes longer than
        that drafting). The copy and the few launches computing r count as verify time. A row that
        ends at an end-of-sequence token early in a group costs the group's steps after it: at most
        check_every - 1 (a copy taken before the group's last step would cost an answer ending at
        EOS 2.5 steps on average with groups of 4)."""
        timing = {"draft": 0.0, "verify": 0.0, "launch": 0.0, "launched": 0, "syncs": 0}
        cuda = self.tokens.device.type == "cuda"
        drafted = False
        if self.graphed and (self.graphs is None or self.state_ids != _state_ids(self.proposer)):
            self._capture()
            timing["launched"], drafted = len(self._warmup_widths()), True  # the warm-up steps were real, and drafted
        if not drafted:
            t0 = time.perf_counter()
            self._phase("draft", self.draft_phase)
            timing["launch"] += time.perf_counter() - t0
        if cuda:  # two sets, used in turn: a group's events are read while the next group runs
            events = [[[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(check_every)]
                      for _ in range(2)]
            # [tokens left] or, adaptive, [tokens left, chosen width]
            left_host = torch.zeros(1 if self.adaptive is None else 2, dtype=torch.long, pin_memory=True)
            left_copied = torch.cuda.Event()

        def phases():  # the verify step of the width last read, then the proposer's step
            w = self.width
            return ((("verify", w), self._verify_at(w), "verify"), ("proposer", self.proposer_phase, "draft"))

        per_step = self.k + 1  # the most tokens a step emits per row (a narrower step emits fewer)
        unread = None  # (events, steps) of the group launched last, timed after the next launch
        left = None  # the most tokens an unfinished row may still emit after the steps launched (None: read it)
        groups = 0

        def read(group):
            group_events, n = group
            group_events[n - 1][2].synchronize()  # (the next group is queued already: the GPU does not wait)
            for e in group_events[:n]:
                timing["verify"] += e[0].elapsed_time(e[1]) / 1e3
                timing["draft"] += e[1].elapsed_time(e[2]) / 1e3

        while timing["launched"] < max_steps:
            if left is None:  # (the first group, and every group on a CPU) read with the GPU drained
                left = self._take(self._readout().tolist())
                timing["syncs"] += 1
            if left <= 0:  # every row is done
                break
            steps = max(1, min(check_every, -(-left // per_step), max_steps - timing["launched"]))
            group = events[groups % 2] if cuda else None
            for i in range(steps):
                for j, (index, phase, name) in enumerate(phases()):
                    if cuda:
                        group[i][j].record()
                    t0 = time.perf_counter()
                    self._phase(index, phase)
                    elapsed = time.perf_counter() - t0
                    timing["launch"] += elapsed
                    if not cuda:
                        timing[name] += elapsed
                    if cuda and j == 0 and i == steps - 1:  # what the rows still need after the group, to the host
                        left_host.copy_(self._readout(), non_blocking=True)
                        left_copied.record()
                if cuda:
                    group[i][2].record()
            timing["launched"] += steps
            groups += 1
            left = None
            if cuda:
                if unread is not None:  # the previous group's times, read while this one runs
                    read(unread)
                unread = (group, steps)
                left_copied.synchronize()  # the GPU is running the last step's proposer phase meanwhile
                timing["syncs"] += 1
                left = self._take(left_host.tolist())  # (the width: chosen by that step's drafts, one step stale)
        if unread is not None:
            read(unread)
        timing["syncs"] += 1  # the read of the outputs
        return timing

    def _left(self) -> torch.Tensor:
        """The most tokens an unfinished row may still emit (a 0-dim device tensor; 0: all done)."""
        return torch.where(self.done, 0, self.budget - self.n_out).max()

    def _readout(self) -> torch.Tensor:
        """What the host reads between groups: [tokens left (`_left`)], and with adaptive verification
        the width the drafts chose after it ([2]); a fixed k launches nothing more than `_left`."""
        if self.adaptive is None:
            return self._left()[None]  # [1] (a view)
        return torch.stack([self._left(), self.chosen])

    def _take(self, read: list[int]) -> int:
        """The host's side of `_readout`: the width to launch next (adaptive), and tokens left."""
        if len(read) > 1:
            self.width = read[1]
        return read[0]

    def _phase(self, i, fn):
        if self.graphs is not None:
            self.graphs[i].replay()
        else:
            fn()


SPEC_CHECK_EVERY = 2  # on a GPU: speculative steps between reads of the done flags


def device_speculation(model, cache, proposer, prompts, aux, first, max_new_tokens, eos_ids, max_len, stats,
                       cuda_graphs, temperature, top_k, top_p, verification, generator, t_start,
                       adaptive=None) -> list[list[int]]:
    """The speculative steps of `generate` for an `on_device` proposer, after the prefill: the
    loop of this shape (kept on the model, its graphs captured once) serves the prompts; fills
    `stats` and returns the outputs. `first` [B] holds each row's first token. `adaptive`
    (inference/runtime/adaptive.py AdaptiveVerification, or None: k drafts per step) verifies the
    width the drafts' confidences choose."""
    B, k = len(prompts), proposer.k
    device = model.embed_tokens.weight.device
    first = torch.as_tensor(first, device=device)  # [B]
    key = ("spec", id(cache), id(proposer), B, max_len, k, tuple(eos_ids), temperature, top_k, top_p, verification,
           id(generator), cuda_graphs, kernel_settings(), None if adaptive is None else repr(adaptive))
    caps = capabilities(proposer)
    tree = caps.tree
    if adaptive is not None and (tree or not caps.confidences):
        raise ValueError(f"adaptive verification needs a chain proposer that estimates its drafts' acceptance "
                         f"(a confidence head, as DSpark's); {type(proposer).__name__} does not")
    if tree and verification.startswith("synthetic:"):
        raise ValueError(f"draft trees verify against the target, not {verification!r}")
    if tree and temperature > 0 and verification != "standard":
        raise ValueError(f"draft trees sample with one target draw per node (standard verification), not {verification!r}")
    if tree:
        from inference.tree.plan import TreeLoop
    make = TreeLoop if tree else SpecLoop
    # chains and trees alike: captured in CUDA graphs where the loop can be (SpecLoop.graphed:
    # on CUDA, a graphable model, a generator graphs can draw from), eager otherwise
    loop = reuse(model, key, lambda: make(model, cache, proposer, B, max_len, k, eos_ids, temperature, top_k, top_p,
                                           verification, generator, graphed=cuda_graphs,
                                           **({} if adaptive is None else {"adaptive": adaptive})))
    with record_function("draftsmith.proposer_begin"):
        if cuda_graphs and device.type == "cuda" and caps.begin_graphed:
            proposer.begin_graphed(prompts, aux, first)  # one replay, its inputs queued behind the prefill
        else:
            proposer.begin(prompts, aux, first.tolist())
    with record_function("draftsmith.loop_reset"):
        loop.reset(prompts, first, max_new_tokens)
        if device.type == "cuda":  # the setup ends here: its time is reported apart
            torch.cuda.synchronize(device)
    setup_end = time.perf_counter()
    with record_function("draftsmith.loop_run"):
        warmup = max(2, k) if adaptive is not None else 2  # (the steps a first capture runs: SpecLoop._warmup_widths)
        timing = loop.run(max_steps=max_new_tokens + warmup, check_every=SPEC_CHECK_EVERY if device.type == "cuda" else 1)
    with record_function("draftsmith.read_outputs"):
        n_out, rows = loop.n_out.tolist(), loop.tokens.tolist()
    outputs = [row[len(p): len(p) + n] for row, p, n in zip(rows, prompts, n_out)]
    stats.row_histograms = loop.histogram.tolist()
    stats.histogram = [sum(column) for column in zip(*stats.row_histograms)]
    stats.steps = int(loop.row_steps.max())
    stats.draft_seconds, stats.verify_seconds = timing["draft"], timing["verify"]
    stats.launch_seconds = timing["launch"]
    stats.launched_steps = timing["launched"]
    stats.setup_seconds = setup_end - t_start
    stats.host_syncs, stats.device_loop = timing["syncs"] + 1, True  # + the sync that ends the setup
    stats.graphed = loop.graphs is not None
    stats.verify_tokens = caps.verify_tokens
    if adaptive is not None:
        stats.verified_drafts = int(loop.verified.sum())
    if caps.end:
        proposer.end(outputs)
    return outputs


def _state_ids(proposer) -> tuple:
    """Identity of the proposer's state tensors: a proposer that re-allocated its state (a new
    batch size) needs new graphs."""
    return tuple(id(v) for v in vars(proposer).values() if isinstance(v, torch.Tensor))
