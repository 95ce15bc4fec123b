"""Adaptive verification: how many drafts each step verifies, from the proposer's confidences and
a measured step-cost table, so that the expected tokens emitted per unit of time are largest.

A proposer with a confidence head (DSpark) gives with its drafts c[b, j], its estimate that draft
j of row b is accepted given drafts 0..j-1 were; the survival s[b, j] = prod_{i<=j} c[b, i] is the
probability that the first j + 1 drafts are all accepted. Verifying the first L_b drafts of row b
emits 1 + sum_{j<L_b} s[b, j] tokens on average (the bonus token, or the target's token at the
first rejection, is always emitted), whatever the temperature: greedy and rejection sampling both
accept draft j only after drafts 0..j-1. Truncating a row's drafts changes which positions are
verified, never what an emitted token is at T = 0 (greedy output stays the target's argmax); at
T > 0 the token after the last verified draft is drawn from the target, as after a full block, and
the output keeps the target's distribution as long as whether draft j is verified does not depend
on draft j (nor on the drafts after it): the causal rule below.

A step costs draft_ms (the proposer's work, paid whatever is verified: drafts come before their
confidences) plus the target's verify forward. The runtime's verify step is padded: B rows of
w + 1 tokens each (the last verified token and w drafts), so its cost is verify_ms(B, w + 1) with
w = max_b L_b, and a row verifying fewer drafts than the width saves nothing. The best choice at a
width w is therefore every running row verifying w drafts, and the step picks

    w* = argmax_w  sum_{b running} (1 + sum_{j<w} s[b, j])  /  (draft_ms(B) + verify_ms(B, w + 1))

over w = 1..k: exact (the few widths are all tried), global across the batch (one width for all
rows, set by their summed survivals). When drafts are sampled (T > 0) the width grows instead while
one more draft raises the rate (`choose_width(causal=True)`): whether draft j is verified must not
depend on draft j itself, or the verified drafts would no longer be q's draws. The width stays >= 1: the verification kernels take at least
one draft per row, and a drafter whose first draft is not worth verifying is not worth running. `choose_width` computes it from tensors without a host sync,
so the device loop can run it inside its captured graphs; `choose_lengths` gives the per-row
lengths (w* for running rows, 0 for finished ones).

The cost table (`StepCosts`) is measured once per target, dtype and GPU by `measure_step_costs`
(CUDA-graph replays timed with CUDA events on a GPU, the host clock on a CPU), saved and loaded as
JSON, and recorded in the outputs whose speed it sets (bench.json).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

FORMAT = "draftsmith-step-costs/1"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)  # (JSON's true would read as 1)


def _positive_finite(v) -> bool:
    return _number(v) and 0 < v < float("inf")


@dataclass(frozen=True)
class StepCosts:
    """Measured step costs of one target on one device.

    verify_ms[str(B)][n - 1]: milliseconds of the target's verify step feeding n tokens to each of
    B rows (n = 1 .. k + 1; B * n tokens verified in all). draft_ms[str(B)]: the proposer's
    milliseconds per step at batch B (0 when not measured: the choice then prices the verify step
    alone, which favours shorter widths). Keys are strings so the JSON round-trips."""

    target: str
    device: str
    dtype: str
    verify_ms: dict[str, list[float]]
    draft_ms: dict[str, float] = field(default_factory=dict)
    context: int = 0  # the cache position the timed steps verified at

    def __post_init__(self):
        if not self.verify_ms:
            raise ValueError("a step-cost table needs at least one batch size")
        for b, row in self.verify_ms.items():
            if not str(b).isdigit() or int(b) < 1:
                raise ValueError(f"step costs: batch size {b!r} is not a positive integer")
            if not row or any(not _positive_finite(v) for v in row):
                raise ValueError(f"step costs at batch {b}: verify times must be positive numbers, got {row}")
        for b, v in self.draft_ms.items():
            if not str(b).isdigit() or not (_positive_finite(v) or (_number(v) and v == 0)):
                raise ValueError(f"step costs: draft time at batch {b!r} must be a number >= 0, got {v!r}")

    def batch_key(self, batch: int) -> str:
        """The measured batch size that prices `batch`: the smallest at least as large, else the largest."""
        sizes = sorted(int(b) for b in self.verify_ms)
        return str(next((b for b in sizes if b >= batch), sizes[-1]))

    def row(self, batch: int, k: int) -> tuple[float, list[float]]:
        """(draft_ms, verify_ms for n = 1 .. k + 1 tokens per row) at `batch`; a ValueError when the
        table was measured for fewer than k + 1 tokens per row."""
        key = self.batch_key(batch)
        verify = self.verify_ms[key]
        if len(verify) < k + 1:
            raise ValueError(f"the step-cost table holds verify times up to {len(verify)} tokens per row; "
                             f"k={k} needs {k + 1} (measure it again with a larger k)")
        return float(self.draft_ms.get(key, 0.0)), [float(v) for v in verify[: k + 1]]

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a step-cost table (format {FORMAT!r} expected)")
        context = d.get("context", 0)
        if not (isinstance(context, int) and not isinstance(context, bool) and context >= 0):
            raise ValueError(f"step-cost table: context {context!r} is not a cache position (a whole number >= 0)")
        try:
            return cls(target=str(d["target"]), device=str(d["device"]), dtype=str(d["dtype"]),
                       verify_ms={str(b): list(v) for b, v in d["verify_ms"].items()},
                       draft_ms={str(b): v for b, v in d.get("draft_ms", {}).items()}, context=context)
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"step-cost table: missing or malformed field ({e})") from None

    def save(self, path: str | Path) -> None:
        from export.io import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "StepCosts":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: no such step-cost table") from None
        except OSError as e:  # a folder, an unreadable file
            raise ValueError(f"{path}: cannot read the step-cost table ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON step-cost table ({e})") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class AdaptiveVerification:
    """The loop's setting: verify a width chosen per step from `costs` (None: a fixed k)."""

    costs: StepCosts

    def record(self) -> dict:
        """What outputs record about it (bench.json): the whole table it priced steps with."""
        return {"adaptive_verification": True, "step_costs": self.costs.to_dict()}


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """confidence [B,k] (per-position acceptance given the earlier drafts) → survival [B,k]."""
    return confidence.float().clamp(0, 1).cumprod(-1)


def expected_tokens(survivals: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Expected tokens emitted by the running rows when every one verifies w drafts, w = 0..k:
    [k+1] (float32), from survival [B,k] and active [B] bool."""
    per_width = (survivals * active[:, None]).sum(0)  # [k]
    n_active = active.float().sum()[None]
    return torch.cat([n_active, n_active + per_width.cumsum(0)])


def choose_width(confidence: torch.Tensor, active: torch.Tensor, step_ms: torch.Tensor,
                 causal: bool = False) -> torch.Tensor:
    """The width w in 1..k (a 0-dim long tensor, on confidence's device, no host sync) for
    confidence [B,k], active [B] bool, step_ms [k+1] the cost of a step verifying w drafts per row
    (draft_ms + verify_ms(B, w + 1)), w = 0..k.

    causal=False: the width maximising expected tokens per millisecond (ties: the smaller). For
    greedy decoding: any width is lossless there.
    causal=True: widen while one more draft raises the rate, stop at the first width that it does
    not. For sampled drafts: the decision to verify draft j then depends on the survivals up to
    j only, which a confidence head computes from the drafts before j (DSpark: the Markov
    embedding of draft j-1), never on draft j itself. A width chosen after seeing the drafts it
    gates would skew them (drafts verified only where the later ones look good are not q's draws),
    and rejection sampling's output would no longer follow the target. With concave expected tokens
    (survivals fall along a row) and costs convex in the width, the first local maximum is the
    global one."""
    rate = expected_tokens(survival(confidence), active)[1:] / step_ms[1:]  # [k]: widths 1..k
    if not causal:
        return rate.argmax() + 1
    wider = rate[1:] > rate[:-1]  # [k-1]: width w+1 beats w
    return 1 + wider.long().cumprod(0).sum()


def step_ms_tensor(costs: StepCosts, batch: int, k: int, device) -> torch.Tensor:
    """[k+1] float32: the cost of a step at `batch` verifying w = 0..k drafts per row."""
    draft, verify = costs.row(batch, k)
    return torch.tensor([draft + v for v in verify], dtype=torch.float32, device=device)


def choose_lengths(confidence: torch.Tensor, active: torch.Tensor, costs: StepCosts, causal: bool = False) -> list[int]:
    """Per-row draft lengths to verify (host form, for tests and offline predictions): the chosen
    width for the running rows, 0 for the finished ones."""
    B, k = confidence.shape
    w = int(choose_width(confidence.cpu(), active.cpu(), step_ms_tensor(costs, B, k, "cpu"), causal))
    return [w if bool(a) else 0 for a in active.cpu()]


def objective(lengths: list[int], confidence: torch.Tensor, active: torch.Tensor, costs: StepCosts) -> float:
    """Expected tokens per millisecond of a step verifying lengths[b] drafts of row b in the padded
    verify step (width max(lengths)); finished rows emit nothing."""
    B, k = confidence.shape
    draft, verify = costs.row(B, k)
    s = survival(confidence)
    tokens = sum(1.0 + float(s[b, :n].sum()) for b, n in enumerate(lengths) if bool(active[b]))
    return tokens / (draft + verify[max(lengths)])


@torch.no_grad()
def measure_step_costs(model, batches: list[int], max_tokens: int, aux_layers: tuple = (), context: int = 256,
                       repeats: int = 5, target: str = "", draft_ms: dict | None = None) -> StepCosts:
    """Time the target's verify step, B rows of n tokens at positions context .. context + n - 1,
    for each B in `batches` and n = 1 .. max_tokens, as the device loop runs it (the forward that
    also returns the `aux_layers` features the proposer reads): on a GPU one CUDA graph per shape,
    replayed `repeats` times between CUDA events (median); on a CPU eager calls on the host clock
    (median). `draft_ms` {B: ms}: the proposer's part of a step, advance and draft (the device
    loop's draft_ms_per_step at a fixed k: bench measures it so), else 0."""
    from inference.runtime.graphs import capture_graph

    if max_tokens < 1 or not batches or min(batches) < 1 or repeats < 1:
        raise ValueError("measure_step_costs: max_tokens, every batch size and repeats must be >= 1")
    p = model.embed_tokens.weight
    cuda = p.device.type == "cuda"
    verify_ms = {}
    for B in batches:
        cache = model.new_cache(B, context + max_tokens + 1)
        row = []
        for n in range(1, max_tokens + 1):
            ids = torch.zeros(B, n, dtype=torch.long, device=p.device)
            positions = (context + torch.arange(n, device=p.device)).expand(B, n).contiguous()

            def step():
                model(ids, positions, cache, aux_layers)

            times = []
            if cuda:
                graph = capture_graph(step)
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                del graph
            else:
                step()  # warm-up
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    step()
                    times.append(1e3 * (time.perf_counter() - t0))
            row.append(max(statistics.median(times), 1e-6))
        verify_ms[str(B)] = row
    return StepCosts(target=target, device=torch.cuda.get_device_name(p.device) if cuda else "cpu",
                     dtype=str(p.dtype).removeprefix("torch."), verify_ms=verify_ms,
                     draft_ms={str(b): float(v) for b, v in (draft_ms or {}).items()}, context=context)
