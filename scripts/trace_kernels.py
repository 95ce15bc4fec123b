"""What a profiler trace's GPU did, kernel by kernel: the Chrome traces `profile_spec.py --trace`
writes (trace-NAME.json.gz), summarised per kernel name (count, total and mean µs) and by the
gaps between consecutive kernels (launch latency inside a CUDA graph, host waits outside).

    python scripts/trace_kernels.py trace-EAGLE-3_k7.json.gz [--top 25] [--range draftsmith.loop_run]

`--range` keeps only the kernels that run inside the time span of a named host range (the
engine's record_function names: draftsmith.prefill, draftsmith.proposer_begin, ...); kernels of
a CUDA graph run after their launch, so the span of a range is taken up to the next range's start.
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarise(events: list[dict], span: tuple[float, float] | None = None, top: int = 25) -> str:
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    if span is not None:
        kernels = [e for e in kernels if span[0] <= e["ts"] < span[1]]
    if not kernels:
        return "no kernels"
    per_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per_name[e["name"]][0] += 1
        per_name[e["name"]][1] += e["dur"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:])]
    busy = sum(e["dur"] for e in kernels)
    wall = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    small = [g for g in gaps if 0 <= g < 20]  # inside a graph or a stream of queued launches
    large = [g for g in gaps if g >= 20]  # the GPU waited for the host
    lines = [f"{len(kernels)} kernels, {busy / 1e3:.3f} ms busy of {wall / 1e3:.3f} ms; gaps < 20 µs: {len(small)}, "
             f"{sum(small) / 1e3:.3f} ms (mean {sum(small) / max(len(small), 1):.2f} µs); gaps >= 20 µs: {len(large)}, "
             f"{sum(large) / 1e3:.3f} ms"]
    lines.append(f"{'count':>7s} {'total µs':>10s} {'mean µs':>8s}  kernel")
    for name, (n, total) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{n:7d} {total:10.1f} {total / n:8.2f}  {name[:110]}")
    return "\n".join(lines)


def range_span(events: list[dict], name: str) -> tuple[float, float]:
    """From the start of host range `name` to the start of the next draftsmith range after it ends."""
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("draftsmith.")),
                    key=lambda e: e["ts"])
    mine = [e for e in ranges if e["name"] == name]
    if not mine:
        raise SystemExit(f"error: no range {name!r} in the trace (have: {sorted({e['name'] for e in ranges})})")
    start = mine[0]["ts"]
    end = mine[0]["ts"] + mine[0]["dur"]
    later = [e["ts"] for e in ranges if e["ts"] >= end]
    return start, (min(later) if later else float("inf"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--range", default=None, help="a draftsmith.* range name: only the kernels of its span")
    args = ap.parse_args(argv)
    events = load(args.trace)
    span = range_span(events, args.range) if args.range else None
    print(summarise(events, span, args.top))


if __name__ == "__main__":
    main()
