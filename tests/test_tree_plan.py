"""The tree step launches what its plan says (inference/tree/plan.py `STEP`), in that order, and no
more: a tree generation through every kernel (the Triton interpreter on a CPU), each Triton
launch recorded by phase. Each depth's head and merge, the frontier at every depth but the last,
then one rerank, which makes the last verify's cache moves in programs of its own exactly when a
verify came before; the verify's argmax chunks and one accept; the advance. The fused epilogues
leave no launch of their own (no feed, emit, move or next-input kernel in the step)."""
from draftsmith_kernels.settings import KernelSettings
from inference.runtime.engine import generate
from inference.tree import plan
from inference.tree.loop import EagleTreeProposer

UNFUSED = {"_feed_kernel", "_emit_kernel", "_move_entries_kernel", "_advance_inputs_kernel"}


def _expected_draft(depth: int) -> list[str]:
    """The named kernels of launches 1-5 (STEP up to the rerank) for a tree of `depth` levels."""
    draft = [launch for launch in plan.STEP[: [s.name for s in plan.STEP].index("rerank") + 1] if launch.kernel]
    names = []
    for level in range(depth):
        names += [s.kernel for s in draft if s.depths == "each" or (s.depths == "inner" and level + 1 < depth)]
    return names + [s.kernel for s in draft if s.depths == "once"]


def test_the_step_launches_its_plan_in_order(tiny_target, monkeypatch):
    from draftsmith_kernels.tree_select import _rerank_kernel
    from tests.test_spec_loop import kernel_case
    from tests.test_tree_acceptance import _small_vocab_eagle3

    device, hf, rt, prompts, max_new, eos, n, plain = kernel_case(tiny_target, 16)
    # trees accepted deep down (the draft vocabulary: the tokens the target answers with), so the
    # reranks do move cache entries
    drafter = _small_vocab_eagle3(hf, sorted({t for o in plain for t in o} | set(range(4)))).to(device)
    depth = 3
    proposer = EagleTreeProposer(drafter, depth=depth, top_k=3, total_tokens=10, batch=len(prompts), max_len=n,
                                 target_config=rt.config)
    log = []  # ("phase", name) markers and ("kernel", name, grid) launches, in order
    launcher = type(_rerank_kernel)  # Triton's JITFunction on a GPU, its interpreter's function on a CPU
    run = launcher.run

    def recorded(self, *args, grid, warmup, **kwargs):
        log.append(("kernel", self.fn.__name__, grid if callable(grid) else tuple(grid)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def marked(name, method):
        def call(loop, *args, **kwargs):
            log.append(("phase", name if name != "draft" else f"draft{'+moves' if kwargs['after_verify'] else ''}"))
            return method(loop, *args, **kwargs)
        return call

    monkeypatch.setattr(launcher, "run", recorded)
    for name in ("draft", "verify", "advance"):
        monkeypatch.setattr(plan.TreeLoop, name, marked(name, getattr(plan.TreeLoop, name)))
    outs, stats = generate(rt, prompts, max_new, proposer=proposer, eos_ids=eos, max_len=n, cuda_graphs=False,
                           kernels=KernelSettings(mode="force"))
    assert outs == plain and sum(c for h in stats.row_histograms for c in h[2:]) > 0  # paths of two nodes moved

    segments = []  # (phase, [(kernel, grid)]) from each phase's marker to the next
    for entry in log:
        if entry[0] == "phase":
            segments.append((entry[1], []))
        elif segments:
            segments[-1][1].append(entry[1:])
    phases = [p for p, _ in segments]
    assert phases[0] == "draft" and phases[1:4] == ["verify", "advance", "draft+moves"], phases
    named = {s.kernel for s in plan.STEP if s.kernel}
    want = {"draft": _expected_draft(depth), "verify": ["_argmax_chunks_kernel", "_tree_accept_kernel"],
            "advance": ["_keep_entry_kernel"]}
    rerank_programs = {}
    for phase, launches in segments:
        kernels = [k for k, _ in launches]
        assert not UNFUSED & set(kernels), (phase, UNFUSED & set(kernels))
        assert [k for k in kernels if k in named] == want[phase.split("+")[0]], phase
        if phase.startswith("draft"):
            rerank_programs.setdefault(phase, set()).add(next(g for k, g in launches if k == "_rerank_kernel")[1])
    # the moves: a program a target layer past the ranking ones, only in a draft after a verify
    (first,), (after,) = rerank_programs["draft"], rerank_programs["draft+moves"]
    assert after == first + rt.config.num_layers

