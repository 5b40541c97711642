"""One PNG per operator from bench/results/neptune_ops.csv: throughput against S for
neptune_eq and every peer (decodes also captured in a CUDA graph, dashed).

    python bench/plot.py [--results bench/results]

Writes ``plots/<op>.png`` beside the CSV, drawn with matplotlib (``pip install -e
".[bench]"``; the field's plotting library, headless through its Agg backend).
"""
from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

COLORS = {"neptune_eq": "#d62728", "sdpa": "#1f77b4", "flex": "#2ca02c", "compile": "#9467bd"}
LABELS = {"neptune_eq": "neptune_eq", "sdpa": "SDPA", "flex": "FlexAttention",
          "compile": "torch.compile"}


def _num(v):
    """A measured number, or None for an empty cell or a failure ('failed: ...')."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def series(rows: list[dict]) -> dict[tuple[str, bool], list[tuple[int, float]]]:
    """(implementation, captured in a CUDA graph) -> [(S, throughput)], measured points only."""
    rows = sorted(rows, key=lambda r: int(r["S"]))
    out = {}
    for impl in COLORS:
        for graphed in (False, True):
            key = f"graph_{impl}" if graphed else impl
            pts = [(int(r["S"]), _num(r.get(key))) for r in rows]
            pts = [(s, v) for s, v in pts if v is not None]
            if pts:
                out[(impl, graphed)] = pts
    return out


def plot_op(op: str, rows: list[dict], title: str) -> bytes:
    """Throughput vs S (log2 axis) for one operator, as PNG bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for (impl, graphed), pts in series(rows).items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "--" if graphed else "-", marker="o", color=COLORS[impl],
                label=LABELS[impl] + (" (CUDA graph)" if graphed else ""))
    ax.set_xscale("log", base=2)
    seqs = sorted({int(r["S"]) for r in rows})
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_xlabel("S")
    ax.set_ylabel(rows[0].get("unit") or "")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, color="#dddddd")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="bench/results")
    a = ap.parse_args()
    res = Path(a.results)
    rows = list(csv.DictReader(open(res / "neptune_ops.csv")))
    out = res / "plots"
    out.mkdir(exist_ok=True)
    gpu = ""
    md = res / "neptune_ops.md"
    if md.exists():  # "# Neptune's operators on NVIDIA H200 (torch ..."
        head = md.read_text().splitlines()[0]
        gpu = head.split(" on ", 1)[-1].split(" (")[0]
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op and _num(r.get("neptune_eq")) is not None]
        if not mine:
            continue
        (out / f"{op}.png").write_bytes(plot_op(op, mine, f"{op} on {gpu}".strip()))
        print(f"wrote {out / (op + '.png')}")


if __name__ == "__main__":
    main()
