"""The validation report (`python -m inference.validate`): `ValidationReport`, and report.json,
report.md and three PNG charts written from it into a temporary folder renamed into place, so a
cut run leaves no half report."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.acceptance import Acceptance, require_keys


@dataclass(frozen=True)
class Promised:
    """What the measurement is held to: the export's promise at the served setting cut to the
    served k (tau recomputed from a_1..a_k; the histogram only when k is the promise's own), or,
    from an export that promises nothing, training's predictor replayed on the served answers
    (temperature and verification None). per_turn: {"1" | "2+": {"tau", "num_chains"}}, what
    `turn_mix` weighs."""

    a: tuple[float, ...]
    tau: float
    histogram: tuple | None
    source: str
    temperature: float | None = None
    verification: str | None = None
    tau_se: float | None = None
    per_turn: dict[str, dict] | None = None

    def to_dict(self) -> dict:
        out = {"a": list(self.a), "tau": self.tau, "histogram": None if self.histogram is None else list(self.histogram)}
        if self.temperature is not None:
            out.update(temperature=self.temperature, verification=self.verification)
        out["source"] = self.source
        out.update({key: value for key, value in (("tau_se", self.tau_se), ("per_turn", self.per_turn)) if value is not None})
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "predicted") -> Promised:
        require_keys(d, ("a", "tau", "histogram", "source"), where)
        return cls(tuple(d["a"]), d["tau"], None if d["histogram"] is None else tuple(d["histogram"]), d["source"],
                   d.get("temperature"), d.get("verification"), d.get("tau_se"), d.get("per_turn"))


@dataclass(frozen=True)
class Measured:
    """Acceptance the runtime measured while serving, and the tokens per second it served at."""

    acceptance: Acceptance
    tokens_per_s: float

    def to_dict(self) -> dict:
        return {**self.acceptance.to_dict(), "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Measured:
        require_keys(d, ("tokens_per_s",), where)
        return cls(Acceptance.from_dict(d, where), d["tokens_per_s"])


@dataclass(frozen=True)
class ValidationReport:
    """One validation (inference/validate.py): what was served, the promise, the measured and
    replayed acceptance, per category and turn, the verdict and the diagnosis. report.json is
    its to_dict; per_turn is keyed by turn number (JSON writes the keys as strings)."""

    drafter: str
    target: str
    dataset: str
    k: int
    temperature: float
    verification: str
    device: str
    num_questions: int
    questions_planned: int
    num_answers: int
    batch_size: int
    max_new_tokens: int
    predicted: Promised
    measured: Measured
    replay_answers: Acceptance
    replay_prompts: Acceptance
    per_category: dict[str, Acceptance]
    per_turn: dict[int, Acceptance]
    turns: dict | None  # inference.validate.turn_mix, where both sides know their turns
    relative_gap: float
    tolerance: float
    passed: bool  # "pass" in report.json
    references: dict[str, Measured]
    tree: dict | None  # {depth, top_k, total_tokens[, children], verify_tokens_per_step} when trees were served
    diagnosis: tuple[str, ...] = ()
    kernels: dict | None = None  # the runtime's kernel settings (KernelSettings.record; None: a report from before them)
    adaptive: dict | None = None  # adaptive verification served (inference.validate_adaptive): its step-cost table

    def to_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in SETTINGS},
                "predicted": self.predicted.to_dict(), "measured": self.measured.to_dict(),
                "replay_answers": self.replay_answers.to_dict(), "replay_prompts": self.replay_prompts.to_dict(),
                "per_category": {c: s.to_dict() for c, s in self.per_category.items()},
                "per_turn": {t: s.to_dict() for t, s in self.per_turn.items()}, "turns": self.turns,
                "relative_gap": self.relative_gap, "tolerance": self.tolerance, "pass": self.passed,
                "references": {name: r.to_dict() for name, r in self.references.items()}, "tree": self.tree,
                "diagnosis": list(self.diagnosis), "kernels": self.kernels, "adaptive_verification": self.adaptive}

    @classmethod
    def from_dict(cls, d: dict, where: str = "report.json") -> ValidationReport:
        require_keys(d, KEYS, where)
        return cls(**{name: d[name] for name in SETTINGS},
                   predicted=Promised.from_dict(d["predicted"], f"{where}: predicted"),
                   measured=Measured.from_dict(d["measured"], f"{where}: measured"),
                   replay_answers=Acceptance.from_dict(d["replay_answers"], f"{where}: replay_answers"),
                   replay_prompts=Acceptance.from_dict(d["replay_prompts"], f"{where}: replay_prompts"),
                   per_category={c: Acceptance.from_dict(s, f"{where}: per_category {c}") for c, s in d["per_category"].items()},
                   per_turn={int(t): Acceptance.from_dict(s, f"{where}: per_turn {t}") for t, s in d["per_turn"].items()},
                   turns=d["turns"], relative_gap=d["relative_gap"], tolerance=d["tolerance"], passed=d["pass"],
                   references={n: Measured.from_dict(r, f"{where}: references {n}") for n, r in d["references"].items()},
                   tree=d["tree"], diagnosis=tuple(d["diagnosis"]), kernels=d.get("kernels"),
                   adaptive=d.get("adaptive_verification"))


# the served setting and counts, written as they are
SETTINGS = ("drafter", "target", "dataset", "k", "temperature", "verification", "device", "num_questions",
            "questions_planned", "num_answers", "batch_size", "max_new_tokens")
KEYS = SETTINGS + ("predicted", "measured", "replay_answers", "replay_prompts", "per_category", "per_turn", "turns",
                   "relative_gap", "tolerance", "pass", "references", "tree", "diagnosis")


def write_report(report: ValidationReport, dest: Path):
    """report.json, report.md and the charts, written into a temporary folder renamed into place
    (marked as validate's output; an existing --out is replaced only when it is validate's own
    and holds nothing else, nor the drafter validated)."""
    from export.io import atomic_folder, write_json

    with atomic_folder(dest, tool="validate", keep=(report.drafter,)) as out:
        write_json(out / "report.json", report.to_dict())
        _write_markdown(report, out)
        _charts(report, out)


def _write_markdown(report: ValidationReport, out: Path):
    p, m, r = report.predicted, report.measured, report.replay_answers
    rows = ["| position | predicted a_i | replayed a_i | measured a_i |", "|---|---|---|---|"]
    rows += [f"| {i + 1} | {p.a[i]:.3f} | {r.a[i]:.3f} | {m.acceptance.a[i]:.3f} |" for i in range(report.k)]
    cats = ["| category | tau | chains |", "|---|---|---|"]
    cats += [f"| {c} | {s.tau:.3f} | {s.num_chains} |" for c, s in sorted(report.per_category.items())]
    turns = [f"| turn {t} | {s.tau:.3f} | {s.num_chains} |" for t, s in sorted(report.per_turn.items())]
    verdict = "PASS" if report.passed else "FAIL"
    tree = report.tree
    if tree:
        from inference.walks.tree import tree_words

        shape = tuple(tree[key] for key in ("depth", "top_k", "total_tokens", "children") if key in tree)
    drafting = f"k = {report.k}" if not tree else (
        f"EAGLE-2 trees of {tree_words(shape)} ({tree['verify_tokens_per_step']} verify tokens per step; a_i by depth)")
    md = [f"# Acceptance validation: {verdict}", "",
          f"Drafter `{report.drafter}` on target `{report.target}`, {report.dataset} "
          f"({report.num_questions} questions, {report.num_answers} answers), {drafting}, "
          f"T = {report.temperature}" + (f", {report.verification} verification" if report.temperature else "")
          + f", device {report.device}."
          + (f" Stopped by --max-minutes after {report.num_questions} of {report.questions_planned} questions."
             if report.questions_planned > report.num_questions else ""), "",
          f"- predicted tau (from the export, {p.source}): **{p.tau:.3f}**"
          + (f" ± {p.tau_se:.3f}" if p.tau_se is not None else ""),
          f"- measured tau (runtime): **{m.acceptance.tau:.3f}** ({report.relative_gap:+.1%}; tolerance ±{report.tolerance:.0%})",
          f"- replayed tau (training's predictor on the served answers): {r.tau:.3f}", "",
          *_adaptive_lines(report),
          "## Why", "", *[f"- {line}" for line in report.diagnosis], "",
          "## Per position", "", *rows, "", "## Per category and turn", "", *cats, *turns, "",
          *_reference_rows(report),
          "Charts: acceptance_per_position.png, tau_per_category.png, accepted_lengths.png.", ""]
    (out / "report.md").write_text("\n".join(md))


def _adaptive_lines(report: ValidationReport) -> list[str]:
    if not report.adaptive:
        return []
    costs = report.adaptive["step_costs"]
    return [f"Adaptive verification: each step verified the width its drafts' confidences and the step-cost table "
            f"(target {costs['target']}, {costs['device']}, {costs['dtype']}; in report.json) make fastest, at batch "
            f"{report.batch_size}: the promise's choice per chain. Mean verified drafts per row step: "
            f"{report.adaptive['verified_drafts_per_row_step']:.2f} of k = {report.k}.", ""]


def _reference_rows(report: ValidationReport) -> list[str]:
    if not report.references:
        return []
    m = report.measured
    rows = ["## Reference proposers on the same prompts", "", "| proposer | tau | tokens/s |", "|---|---|---|",
            f"| this drafter | {m.acceptance.tau:.3f} | {m.tokens_per_s:,.1f} |"]
    rows += [f"| {name} | {r.acceptance.tau:.3f} | {r.tokens_per_s:,.1f} |" for name, r in report.references.items()]
    return rows + [""]


def _charts(report: ValidationReport, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = report.k
    xs = list(range(1, k + 1))
    predicted, measured = report.predicted, report.measured.acceptance
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, a, style in (("predicted", predicted.a, "o--"), ("replay answers", report.replay_answers.a, "s:"),
                            ("measured", measured.a, "^-")):
        ax.plot(xs, a[:k], style, label=label)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("a_i (conditional acceptance)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title(f"tau predicted {predicted.tau:.2f} / measured {measured.tau:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=110)
    plt.close(fig)

    cats = sorted(report.per_category)
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(cats) + 1.5))
    ax.barh(cats, [report.per_category[c].tau for c in cats], color="#4878a8")
    ax.axvline(predicted.tau, color="#c44", linestyle="--", label="predicted")
    ax.set_xlabel("measured tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_per_category.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for j, (name, hist) in enumerate((("predicted", predicted.histogram), ("measured", measured.histogram))):
        if hist:
            total = max(sum(hist), 1)
            ax.bar([x + (j - 0.5) * width for x in range(len(hist))], [h / total for h in hist], width, label=name)
    ax.set_xlabel("accepted drafts per step")
    ax.set_ylabel("fraction of steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accepted_lengths.png", dpi=110)
    plt.close(fig)
