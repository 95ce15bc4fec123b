"""benchmarks.csv: every row whole and traceable to the log it cites, and BENCHMARKS.md's current
figures taken from it (the newest row of each measure)."""
from __future__ import annotations

import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["measure", "value", "unit", "gpu", "commit", "date", "command", "drafter", "log_line"]


def _rows() -> list[dict[str, str]]:
    with open(ROOT / "benchmarks.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert rows
    return rows


def _spellings(value: str) -> set[str]:
    """How the log may write a CSV value: as is, with thousands separators, with a typographic
    minus, or (seconds) as 'M min S s'."""
    out = {value}
    number = float(value)
    decimals = len(value.split(".")[1]) if "." in value else 0
    grouped = f"{abs(number):,.{decimals}f}"
    for sign in (("-", "−") if number < 0 else ("",)):
        out |= {sign + grouped, sign + value.lstrip("-")}
    if decimals == 0 and number >= 60:
        out.add(f"{int(number) // 60} min {int(number) % 60} s")
    return out


def test_every_row_has_every_column():
    for i, row in enumerate(_rows(), start=2):
        assert all(row[c] and row[c].strip() == row[c] for c in COLUMNS), f"row {i}: {row}"
        float(row["value"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row
        assert re.fullmatch(r"[0-9a-f]{7,40}|not recorded", row["commit"]), row
        assert int(row["log_line"]) > 0


def test_one_row_per_measure_gpu_commit_date():
    keys = [(r["measure"], r["gpu"], r["commit"], r["date"]) for r in _rows()]
    assert len(keys) == len(set(keys))


def test_each_value_is_on_the_log_line_it_cites():
    log = (ROOT / "docs/history/benchmarks-log.md").read_text().split("\n")
    for row in _rows():
        line = log[int(row["log_line"]) - 1]
        assert any(s in line for s in _spellings(row["value"])), (row["measure"], row["value"], line[:120])
        assert row["commit"] == "not recorded" or row["commit"] in "\n".join(
            log[max(0, int(row["log_line"]) - 200):int(row["log_line"])]), row


def test_current_figures_are_the_newest_rows():
    rows = _rows()
    table = [line for line in (ROOT / "BENCHMARKS.md").read_text().split("\n") if line.startswith("| `")]
    assert len(table) >= 20
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        measure, value, date, gpu, commit = cells[0].strip("`"), cells[1], cells[3], cells[4], cells[5].strip("`")
        mine = [r for r in rows if r["measure"] == measure]
        assert mine, f"{measure} is not in benchmarks.csv"
        newest = max(mine, key=lambda r: r["date"])
        assert date == newest["date"], (measure, date, newest["date"])
        match = [r for r in mine if r["date"] == date and r["commit"] == commit]
        assert match, (measure, date, commit)
        assert any(value.startswith(s) for s in _spellings(match[0]["value"])), (measure, value)
        assert gpu.replace("H200", "NVIDIA H200") in match[0]["gpu"] or gpu == match[0]["gpu"], (measure, gpu)
