"""The validation report (`python -m inference.validate`): report.json, report.md and three PNG
charts, written into a temporary folder renamed into place, so a cut run leaves no half report."""
from __future__ import annotations

from pathlib import Path


def write_report(report: dict, dest: Path):
    """report.json, report.md and the charts, written into a temporary folder renamed into place."""
    from export.io import atomic_folder, write_json

    with atomic_folder(dest) as out:
        write_json(out / "report.json", report)
        _write_markdown(report, out)
        _charts(report, out)


def _write_markdown(report: dict, out: Path):
    p, m, r = report["predicted"], report["measured"], report["replay_answers"]
    rows = ["| position | predicted a_i | replayed a_i | measured a_i |", "|---|---|---|---|"]
    rows += [f"| {i + 1} | {p['a'][i]:.3f} | {r['a'][i]:.3f} | {m['a'][i]:.3f} |" for i in range(report["k"])]
    cats = ["| category | tau | chains |", "|---|---|---|"]
    cats += [f"| {c} | {s['tau']:.3f} | {s['num_chains']} |" for c, s in sorted(report["per_category"].items())]
    turns = [f"| turn {t} | {s['tau']:.3f} | {s['num_chains']} |" for t, s in sorted(report["per_turn"].items())]
    verdict = "PASS" if report["pass"] else "FAIL"
    tree = report.get("tree")
    drafting = f"k = {report['k']}" if not tree else (
        f"EAGLE-2 trees of depth {tree['depth']}, top-k {tree['top_k']}, {tree['total_tokens']} nodes "
        f"({tree['verify_tokens_per_step']} verify tokens per step; a_i by depth)")
    md = [f"# Acceptance validation: {verdict}", "",
          f"Drafter `{report['drafter']}` on target `{report['target']}`, {report['dataset']} "
          f"({report['num_questions']} questions, {report['num_answers']} answers), {drafting}, "
          f"T = {report['temperature']}" + (f", {report['verification']} verification" if report['temperature'] else "")
          + f", device {report['device']}."
          + (f" Stopped by --max-minutes after {report['num_questions']} of {report['questions_planned']} questions."
             if report.get("questions_planned", report["num_questions"]) > report["num_questions"] else ""), "",
          f"- predicted tau (from the export, {p.get('source', 'held-out data')}): **{p['tau']:.3f}**"
          + (f" ± {p['tau_se']:.3f}" if "tau_se" in p else ""),
          f"- measured tau (runtime): **{m['tau']:.3f}** ({report['relative_gap']:+.1%}; tolerance ±{report['tolerance']:.0%})",
          f"- replayed tau (training's predictor on the served answers): {r['tau']:.3f}", "",
          "## Why", "", *[f"- {line}" for line in report["diagnosis"]], "",
          "## Per position", "", *rows, "", "## Per category and turn", "", *cats, *turns, "",
          *_reference_rows(report),
          "Charts: acceptance_per_position.png, tau_per_category.png, accepted_lengths.png.", ""]
    (out / "report.md").write_text("\n".join(md))


def _reference_rows(report: dict) -> list[str]:
    refs = report.get("references") or {}
    if not refs:
        return []
    m = report["measured"]
    rows = ["## Reference proposers on the same prompts", "", "| proposer | tau | tokens/s |", "|---|---|---|",
            f"| this drafter | {m['tau']:.3f} | {m['tokens_per_s']:,.1f} |"]
    rows += [f"| {name} | {r['tau']:.3f} | {r['tokens_per_s']:,.1f} |" for name, r in refs.items()]
    return rows + [""]


def _charts(report: dict, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = report["k"]
    xs = list(range(1, k + 1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, style in (("predicted", "o--"), ("replay_answers", "s:"), ("measured", "^-")):
        ax.plot(xs, report[name]["a"][:k], style, label=name.replace("_", " "))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("a_i (conditional acceptance)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title(f"tau predicted {report['predicted']['tau']:.2f} / measured {report['measured']['tau']:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "acceptance_per_position.png", dpi=110)
    plt.close(fig)

    cats = sorted(report["per_category"])
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(cats) + 1.5))
    ax.barh(cats, [report["per_category"][c]["tau"] for c in cats], color="#4878a8")
    ax.axvline(report["predicted"]["tau"], color="#c44", linestyle="--", label="predicted")
    ax.set_xlabel("measured tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau_per_category.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for j, name in enumerate(("predicted", "measured")):
        hist = report[name].get("histogram")
        if hist:
            total = max(sum(hist), 1)
            ax.bar([x + (j - 0.5) * width for x in range(len(hist))], [h / total for h in hist], width, label=name)
    ax.set_xlabel("accepted drafts per step")
    ax.set_ylabel("fraction of steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accepted_lengths.png", dpi=110)
    plt.close(fig)
