"""What `python -m inference.deploy` writes: the copy of the export carrying the draft-length
table, and report.json, report.md and the charts (into the report's temporary folder, which
export.io.atomic_folder renames into place)."""
from __future__ import annotations

import shutil
from pathlib import Path

CHARTS = ("speedup_vs_batch.png", "acceptance_vs_context.png", "acceptance_vs_precision.png")
SECTION_KEYS = ("speed", "context", "precision")  # the report.json section each chart draws


def write_table_copy(export: Path, final: Path, table: dict, inside: Path | None) -> tuple[Path, list[str], list[str]]:
    """A copy of `export` whose draftsmith.json carries `table` (export.io.K_TABLE), with SGLang's
    adaptive config beside it (export/formats.py SGLANG_ADAPTIVE), marked as an export: written
    at `inside` (a folder within the report's temporary folder) when given, else as a folder of
    its own at `final`. The user's export is only read. Returns (where it can be read now, the
    launch lines naming `final`, notes on the servers)."""
    from export.formats import SGLANG_ADAPTIVE, launch_lines, sglang_adaptive_config
    from export.io import K_TABLE, atomic_folder, read_json, write_json
    from export.paths import files_under, write_marker

    def fill(folder: Path):
        for rel in files_under(export):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(export / rel, folder / rel, follow_symlinks=True)
        meta = read_json(folder / "draftsmith.json") if (folder / "draftsmith.json").is_file() else {}
        write_json(folder / "draftsmith.json", {**meta, K_TABLE: table})
        write_json(folder / SGLANG_ADAPTIVE, sglang_adaptive_config(table["rows"]))

    if inside is not None:
        inside.mkdir(parents=True)
        fill(inside)
        write_marker(inside, "export", files_under(inside))
        readable = inside
    else:
        with atomic_folder(final, tool="export") as tmp:
            fill(tmp)
        readable = final
    try:
        lines = [line.replace(str(readable), str(final)) for line in launch_lines(readable)]
    except (ValueError, KeyError) as e:  # an export made elsewhere, without draftsmith's format fields
        lines, why = [], f" ({e})"
    else:
        why = ""
    top = max(k for _, _, k in table["rows"])
    notes = []
    if top == 0:
        notes.append("The table drafts at no batch size measured: serve without speculative decoding there.")
    if not lines:
        notes.append("No server line for this export's layout" + why + "; draftsmith's runtime reads the table "
                     "(export.io.read_k_table).")
    if any(line.startswith("vllm serve") for line in lines) and top:
        notes.append("vLLM 0.33: num_speculative_tokens_per_batch_size is read by model runner V2 for every method and "
                     "by V1 for ngram, eagle, eagle3, mtp, draft_model and dflash; it is dropped with data "
                     "parallelism (vllm/config/vllm.py:1088-1127). Batch sizes past the last row keep its k.")
    sglang = [line for line in lines if "sglang.launch_server" in line]
    if sglang and not any("--speculative-adaptive" in line for line in sglang) and top:
        notes.append("SGLang 0.5.23 has no per-batch draft length for this algorithm (--speculative-adaptive is "
                     "EAGLE / EAGLE3 chains with top-k 1 only): its line drafts a fixed k.")
    elif sglang and top:
        notes.append(f"SGLang 0.5.23: {SGLANG_ADAPTIVE} gives each batch-size slot one candidate k, so "
                     "--speculative-adaptive keeps it fixed per slot (adaptive_spec_params.py); SGLang pads a batch to "
                     "its captured CUDA-graph size before picking the slot.")
    return readable, lines, notes


def write_report(report: dict, out: Path) -> None:
    from export.io import write_json

    write_json(out / "report.json", report)
    (out / "report.md").write_text(markdown(report))
    charts(report, out)


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _tau(bucket: dict, key: str) -> str:
    """A context bucket's tau, "-" where it holds no chain."""
    return _f(bucket[key]["tau"] if bucket[key]["num_chains"] else None)


def markdown(r: dict) -> str:
    md = ["# Deployment report", "",
          f"Drafter `{r['drafter']}` on target `{r['target']}`, {r['dataset']} ({r['num_prompts']} prompts, up to "
          f"{r['max_new_tokens']} new tokens), device {r['device']} ({r['dtype']}), {r['date']}."
          + (f" Speed at a synthetic acceptance of {r['synthetic_acceptance']:g} per draft." if r.get("synthetic_acceptance")
             is not None else ""), ""]
    if "speed" in r:
        names = list(dict.fromkeys(n for s in r["speed"].values() for n in s.get("options", {})))
        md += ["## Speed by batch size (tok/s; tau)", "", "| batch | " + " | ".join(names) + " | best |",
               "|---" * (len(names) + 2) + "|"]
        for b, s in r["speed"].items():
            cells = [f"{s['options'][n]['tokens_per_s']:.1f}" + (f"; {s['options'][n]['tau']:.2f}" if s["options"][n]["tau"]
                                                                 else "") if n in s.get("options", {}) else "-" for n in names]
            best = r["best"].get(b)
            note = f"{best['choice']} ({best['vs_plain']:.2f}x)" if best else (
                "out of memory" if "out_of_memory" in s else s.get("not_run", "-"))
            md.append(f"| {b} | " + " | ".join(cells) + f" | {note} |")
        md.append("")
    if "table" in r:
        t = r["table"]
        md += ["## Draft length by batch size (the table)", "",
               "Rows [first batch, last batch, k] (k = 0: no drafting): " + ", ".join(map(str, t["rows"])) + ".",
               f"Written into `draftsmith.json` of a copy of the export: `{t['copy']}`. Serve it with:", ""]
        md += [f"    {line}" for line in t["launch_lines"]] + [""] + [f"- {n}" for n in t["notes"]] + [""]
    if "table_vs_fixed" in r:
        md += ["## Served with the table against a fixed k", "", "| batch | table k | table tok/s | fixed k | fixed tok/s | "
               "table / fixed |", "|---|---|---|---|---|---|"]
        md += [f"| {b} | {x['table_k']} | {x['table_tokens_per_s']:.1f} | {x['fixed_k']} | {x['fixed_tokens_per_s']:.1f} | "
               f"{x['table_vs_fixed']:.2f}x |" for b, x in r["table_vs_fixed"].items()] + [""]
    if "context" in r:
        c = r["context"]
        md += [f"## Acceptance by preceding context (k = {c['k']}, {c['dataset']})", "",
               "| context (tokens) | answers | drafted positions | measured tau | predicted tau | gap | predicted, by "
               "each chain's context |", "|---|---|---|---|---|---|---|"]
        md += [f"| {b['label']} | {b['answers']} | {b['drafted_positions']} | {_tau(b, 'measured')} | "
               f"{_tau(b, 'predicted')} | {_f(b['relative_gap'], '+.1%')} | {_tau(b, 'predicted_by_chain_context')}"
               + (f" ({b['note']})" if b.get("note") else "") + " |" for b in c["buckets"]] + [""]
    if "precision" in r:
        p = r["precision"]
        md += [f"## Acceptance by target precision (k = {p['k']})", "", "| target weights | tau | vs as loaded | a_i | "
               "answers equal to as loaded |", "|---|---|---|---|---|"]
        md += [f"| {name} | {s['tau']:.3f} | {s['tau_vs_loaded']:.3f}x | " + ", ".join(f"{a:.2f}" for a in s["a"])
               + f" | {s['answers_equal_loaded']}/{s['answers']} |" for name, s in p["schemes"].items()] + [""]
    md.append("Charts: " + ", ".join(name for name, key in zip(CHARTS, SECTION_KEYS) if key in r) + ".")
    return "\n".join(md) + "\n"


def charts(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "speed" in r:
        _speed_chart(plt, r, out / CHARTS[0])
    if "context" in r:
        _context_chart(plt, r, out / CHARTS[1])
    if "precision" in r:
        _precision_chart(plt, r, out / CHARTS[2])


def _speed_chart(plt, r: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    speed = {int(b): s["options"] for b, s in r.get("speed", {}).items() if s.get("options", {}).get("off")}
    names = list(dict.fromkeys(n for o in speed.values() for n in o if n != "off"))
    for name in names:
        xs = [b for b in sorted(speed) if name in speed[b]]
        ax.plot(xs, [speed[b][name]["tokens_per_s"] / speed[b]["off"]["tokens_per_s"] for b in xs], "o-", label=name)
    ax.axhline(1.0, color="#888", linestyle="--", label="plain")
    if speed:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(speed), [str(b) for b in sorted(speed)])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tok/s / plain tok/s")
    ax.legend(fontsize=8)
    ax.set_title(f"speedup by batch size ({r['device']})", fontsize=9)
    _save(fig, path)


def _context_chart(plt, r: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    buckets = r.get("context", {}).get("buckets", [])
    xs = range(len(buckets))
    for key, style in (("measured", "^-"), ("predicted", "o--"), ("predicted_by_chain_context", "s:")):
        ax.plot(xs, [b[key]["tau"] if b[key]["num_chains"] else float("nan") for b in buckets], style,
                label=key.replace("_", " "))
    ax.set_xticks(list(xs), [b["label"] for b in buckets])
    ax.set_xlabel("preceding context (tokens)")
    ax.set_ylabel("tau")
    ax.legend(fontsize=8)
    _save(fig, path)


def _precision_chart(plt, r: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, s in r.get("precision", {}).get("schemes", {}).items():
        ax.plot(range(1, len(s["a"]) + 1), s["a"], "o-", label=f"{name} (tau {s['tau']:.2f})")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("a_i (conditional acceptance)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(r: dict, out: str) -> list[str]:
    lines = []
    for b, best in r.get("best", {}).items():
        lines.append(f"batch {b}: best {best['choice']} ({best['tokens_per_s']:.1f} tok/s, {best['vs_plain']:.2f}x plain)")
    if "table" in r:
        lines += [f"table {r['table']['rows']} written into {r['table']['copy']}; serve it with:",
                  *(f"  {line}" for line in r["table"]["launch_lines"]), *(f"note: {n}" for n in r["table"]["notes"])]
    for b in r.get("context", {}).get("buckets", []):
        lines.append(f"context {b['label']}: measured tau {_tau(b, 'measured')}, predicted {_tau(b, 'predicted')} "
                     f"({b['answers']} answers, {b['drafted_positions']} drafted positions)")
    for name, s in r.get("precision", {}).get("schemes", {}).items():
        lines.append(f"precision {name}: tau {s['tau']:.3f} ({s['tau_vs_loaded']:.3f}x as loaded)")
    return lines + [f"report in {out}/report.md"]
