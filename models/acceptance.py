"""Acceptance as data: a_i, tau and the histogram they come from, and what training promises.

For a chain of k drafts, a_i = P(draft i accepted | drafts 1..i-1 accepted) and
tau = 1 + sum_i prod_{j<=i} a_j (accepted drafts plus the bonus token; plain decoding = 1).
Everything is computed from the histogram of accepted lengths, so counts from many batches,
ranks or requests simply add (docs/design.md, "Acceptance").

These types sit in `models`, the lowest layer, because every other layer passes them on:
training predicts a `Prediction` (train/module.py), checkpoints store it
(models/checkpoint.py), exports copy it into draftsmith.json (export/__main__.py, train/run.py)
and validation holds the runtime's measured `Acceptance` to it (inference/validate.py). On disk
they are the JSON files have always held: `to_dict` writes those keys, and `from_dict` reads
them back, naming the first key a file lacks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def tau_at(a, k: int) -> float:
    """tau of a k-chain from per-position acceptance a_1..a_k (the definition above)."""
    tau, run = 1.0, 1.0
    for x in list(a)[:k]:
        run *= x
        tau += run
    return tau


def require_keys(d, keys, where: str) -> None:
    """A ValueError naming the first of `keys` the JSON object `d` lacks (`where`: what `d` is)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a JSON object is expected, not {type(d).__name__}")
    for key in keys:
        if key not in d:
            raise ValueError(f"{where}: missing key {key!r}")


@dataclass(frozen=True)
class Acceptance:
    """Acceptance of a set of chains: a_1..a_k, tau, the histogram of accepted lengths 0..k and
    the number of chains; tau_se for sampled walks (what tau would vary by over as many chains
    drawn from the histogram); per_turn: the same for chains in first answers ("1") and in
    follow-up turns ("2+"), where training measured them apart."""

    a: tuple[float, ...]
    tau: float
    num_chains: int
    histogram: tuple | None  # counts (expected, fractional ones for sampled walks); None in a promise edited by hand
    tau_se: float | None = None
    per_turn: dict[str, Acceptance] | None = None

    @classmethod
    def from_histogram(cls, hist, with_error: bool = False) -> Acceptance:
        """From counts [k+1] of accepted lengths (integers, or expected counts from a sampled walk).
        with_error: tau_se = sqrt(Var(L) / chains) under the histogram."""
        import torch  # here only: reading and writing the JSON needs none (CLIs check input before loading it)

        hist = torch.as_tensor(hist, dtype=torch.float64)
        k = hist.numel() - 1
        n = hist.sum().item()
        at_least = hist.flip(0).cumsum(0).flip(0)  # at_least[i] = #chains with >= i accepted
        a = tuple((at_least[i] / at_least[i - 1]).item() if at_least[i - 1] > 0 else 0.0 for i in range(1, k + 1))
        tau = 1.0 + (at_least[1:].sum() / n).item() if n else 1.0
        # sampled promises (inference/walks/sampled.py) hold expected, fractional counts
        counts = tuple(int(x) if float(x).is_integer() else x for x in hist.tolist())
        return cls(a, tau, int(round(n)), counts, tau_se=_tau_se(hist) if with_error else None)

    @classmethod
    def by_turn(cls, hist, with_error: bool = False) -> Acceptance:
        """From per-turn counts [2, k+1] (first answers, then follow-up turns): overall, with per_turn."""
        whole = cls.from_histogram(hist.sum(0), with_error)
        turns = {"1": cls.from_histogram(hist[0], with_error), "2+": cls.from_histogram(hist[1], with_error)}
        return cls(whole.a, whole.tau, whole.num_chains, whole.histogram, whole.tau_se, turns)

    def to_dict(self) -> dict:
        out = {"a": list(self.a), "tau": self.tau, "num_chains": self.num_chains,
               "histogram": None if self.histogram is None else list(self.histogram)}
        if self.tau_se is not None:
            out["tau_se"] = self.tau_se
        if self.per_turn is not None:
            out["per_turn"] = {label: turn.to_dict() for label, turn in self.per_turn.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "acceptance") -> Acceptance:
        require_keys(d, ("a", "tau", "num_chains", "histogram"), where)
        turns = d.get("per_turn")
        return cls(tuple(d["a"]), d["tau"], d["num_chains"], None if d["histogram"] is None else tuple(d["histogram"]),
                   d.get("tau_se"), None if turns is None else
                   {label: cls.from_dict(t, f"{where}: per_turn {label}") for label, t in turns.items()})


def _tau_se(hist) -> float:
    """sqrt(Var(L) / chains) of the accepted length L under a float64 histogram tensor."""
    import torch

    n = hist.sum()
    if n <= 0:
        return 0.0
    lengths = torch.arange(hist.numel(), dtype=torch.float64)
    mean = (hist * lengths).sum() / n
    var = (hist * (lengths - mean) ** 2).sum() / n
    return float((var / n).sqrt())


@dataclass(frozen=True)
class Promise:
    """Acceptance promised for serving at one temperature and verification rule (greedy chains:
    temperature 0, "greedy"; sampled ones: inference/walks/sampled.py)."""

    temperature: float
    verification: str
    acceptance: Acceptance

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "verification": self.verification, **self.acceptance.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Promise:
        require_keys(d, ("temperature", "verification"), where)
        return cls(d["temperature"], d["verification"], Acceptance.from_dict(d, where))


@dataclass(frozen=True)
class TreePromise:
    """Acceptance promised for EAGLE-2 draft trees of one shape (inference/walks/tree.py):
    a_i by depth, num_chains = trees drafted. children: what each kept node below the root is
    expanded into, None for top_k (files from before it hold no such key)."""

    depth: int
    top_k: int
    total_tokens: int
    acceptance: Acceptance
    children: int | None = None

    @property
    def verify_tokens_per_step(self) -> int:
        return self.total_tokens + 1  # the root and its nodes

    @property
    def shape(self) -> tuple[int, ...]:
        """(depth, top_k, total_tokens[, children]), as eval.trees and --tree name the tree."""
        return (self.depth, self.top_k, self.total_tokens) + (() if self.children is None else (self.children,))

    def to_dict(self) -> dict:
        return {"depth": self.depth, "top_k": self.top_k, "total_tokens": self.total_tokens,
                **({} if self.children is None else {"children": self.children}),
                "verify_tokens_per_step": self.verify_tokens_per_step, **self.acceptance.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> TreePromise:
        require_keys(d, ("depth", "top_k", "total_tokens"), where)
        return cls(d["depth"], d["top_k"], d["total_tokens"], Acceptance.from_dict(d, where), d.get("children"))


@dataclass(frozen=True)
class HeldoutPrediction:
    """Acceptance predicted on one held-out set: greedy chains, and the sampled and tree
    promises training was asked for (eval.temperatures, eval.trees)."""

    greedy: Acceptance
    sampled: tuple[Promise, ...] = ()
    trees: tuple[TreePromise, ...] = ()

    def to_dict(self) -> dict:
        # files without sampled or tree promises hold the greedy one alone
        return {**self.greedy.to_dict(), **({"sampled": [p.to_dict() for p in self.sampled]} if self.sampled else {}),
                **({"trees": [t.to_dict() for t in self.trees]} if self.trees else {})}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> HeldoutPrediction:
        return cls(Acceptance.from_dict(d, where),
                   tuple(Promise.from_dict(p, f"{where}: sampled[{i}]") for i, p in enumerate(d.get("sampled") or [])),
                   tuple(TreePromise.from_dict(t, f"{where}: trees[{i}]") for i, t in enumerate(d.get("trees") or [])))


@dataclass(frozen=True)
class Prediction:
    """What training promises (`predicted_acceptance` in draftsmith.json, `predicted` in
    predicted.json and in checkpoints): the first held-out set's figures at the top level of
    the JSON, with its name, the chain length k and the training step; `also`: the other
    held-out sets (eval.datasets), by name. dataset, k and step are None in a file that lacks them.
    step_costs: the step-cost table (inference.runtime.adaptive StepCosts.to_dict) the adaptive
    promises were priced with (eval.step_costs), None where none was made or the file predates it."""

    heldout: HeldoutPrediction
    dataset: str | None = None
    k: int | None = None
    step: int | None = None
    temperature: float = 0.0  # the top-level figures are greedy chains'
    also: dict[str, HeldoutPrediction] = field(default_factory=dict)
    step_costs: dict | None = None

    @property
    def greedy(self) -> Acceptance:
        return self.heldout.greedy

    def promise_at(self, temperature: float, verification: str, adaptive: bool = False) -> Promise | None:
        """The promise for serving at this temperature and verification: the greedy one at T = 0,
        else the matching sampled one; None where the file holds none (files written before
        sampled promises hold the greedy one alone). adaptive: the promise made with adaptive
        verification (eval.step_costs; stored in `sampled` as verification "adaptive" at T = 0,
        "adaptive-standard" / "adaptive-block" at T > 0), None where none was made."""
        if temperature == 0 and not adaptive:
            return Promise(0.0, "greedy", self.greedy)
        name = ("adaptive" if temperature == 0 else f"adaptive-{verification}") if adaptive else verification
        return next((p for p in self.heldout.sampled
                     if float(p.temperature) == float(temperature) and p.verification == name), None)

    def for_set(self, name: str) -> Prediction:
        """The promise made on held-out set `name` (the first set or one of `also`) as a
        Prediction of its own; a name the file does not hold is an error listing those it does."""
        if name == self.dataset:
            return self
        if name not in self.also:
            held = [n for n in (self.dataset, *self.also) if n]
            raise ValueError(f"--promise-set {name}: the export promises on {', '.join(held) or 'no named set'} "
                             "(train or `python -m train.promise` with that set in eval.datasets)")
        return Prediction(self.also[name], name, self.k, self.step, self.temperature, step_costs=self.step_costs)

    def to_dict(self) -> dict:
        out = self.heldout.to_dict()
        out.update({key: value for key, value in (("dataset", self.dataset), ("k", self.k)) if value is not None})
        out["temperature"] = self.temperature
        if self.step is not None:
            out["step"] = self.step
        if self.also:
            out["also"] = {name: held.to_dict() for name, held in self.also.items()}
        if self.step_costs is not None:
            out["step_costs"] = self.step_costs
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "predicted acceptance") -> Prediction:
        heldout = HeldoutPrediction.from_dict(d, where)
        also = {name: HeldoutPrediction.from_dict(h, f"{where}: also {name}") for name, h in (d.get("also") or {}).items()}
        costs = d.get("step_costs")
        if costs is not None and not isinstance(costs, dict):
            raise ValueError(f"{where}: step_costs must be a step-cost table (a JSON object), got {type(costs).__name__}")
        return cls(heldout, d.get("dataset"), d.get("k"), d.get("step"), d.get("temperature", 0.0), also, costs)
