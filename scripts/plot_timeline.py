"""Draws PHALANX_TIMELINE traces as one PNG: a row per task and thread, a bar per span.

usage: python scripts/plot_timeline.py OUT.png TRACE.json [TRACE.json ...]

Needs matplotlib (``pip install matplotlib``; not a dependency of phalanx). The interactive
view is chrome://tracing or https://ui.perfetto.dev, which read the same files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLOURS = {
    "forward": "#4c78a8",
    "backward": "#72b7b2",
    "optimizer": "#f58518",
    "collective": "#54a24b",
    "ps": "#e45756",
}


def load(paths: list[Path]) -> tuple[list[tuple[str, list[dict]]], float]:
    """Rows of spans, one per (task, thread), and the earliest start (microseconds)."""
    rows: list[tuple[str, list[dict]]] = []
    for path in paths:
        events = json.loads(path.read_text())["traceEvents"]
        task = next(e["args"]["name"] for e in events if e["name"] == "process_name")
        threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        for tid, thread in sorted(threads.items(), key=lambda item: str(item[1])):
            spans = [e for e in events if e["ph"] == "X" and e["tid"] == tid]
            if spans:
                rows.append((f"{task} / {thread}", spans))
    start = min(e["ts"] for _, spans in rows for e in spans)
    return rows, start


def main(out: str, *traces: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, start = load([Path(t) for t in traces])
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for y, (_, spans) in enumerate(rows):
        for e in spans:
            colour = COLOURS.get(e["cat"], "#b279a2")
            ax.barh(y, e["dur"] / 1000, left=(e["ts"] - start) / 1000, color=colour, edgecolor="white")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(
        handles,
        list(COLOURS),
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncols=len(COLOURS),
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(rows)} rows)")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
