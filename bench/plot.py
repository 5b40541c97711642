"""One PNG per operator from bench/results/neptune_ops.csv: throughput against S for
neptune_eq and every peer (decodes also neptune_eq and the best peer captured in a CUDA
graph, dashed).

    python bench/plot.py [--results bench/results]

Writes ``plots/<op>.png`` beside the CSV.  No plotting library is among the project's
packages, so this draws on a pixel canvas and encodes the PNG itself (zlib + CRC, the
whole format in ``_png``); labels use a 3x5 bitmap font, upper case.
"""
from __future__ import annotations

import argparse
import csv
import math
import struct
import zlib
from pathlib import Path

_FONT = {  # 3 columns x 5 rows per glyph, rows separated by '|', '#' = ink
    "A": ".#.|#.#|###|#.#|#.#", "B": "##.|#.#|##.|#.#|##.", "C": ".##|#..|#..|#..|.##",
    "D": "##.|#.#|#.#|#.#|##.", "E": "###|#..|##.|#..|###", "F": "###|#..|##.|#..|#..",
    "G": ".##|#..|#.#|#.#|.##", "H": "#.#|#.#|###|#.#|#.#", "I": "###|.#.|.#.|.#.|###",
    "J": "..#|..#|..#|#.#|.#.", "K": "#.#|#.#|##.|#.#|#.#", "L": "#..|#..|#..|#..|###",
    "M": "#.#|###|###|#.#|#.#", "N": "##.|#.#|#.#|#.#|#.#", "O": ".#.|#.#|#.#|#.#|.#.",
    "P": "##.|#.#|##.|#..|#..", "Q": ".#.|#.#|#.#|##.|.##", "R": "##.|#.#|##.|#.#|#.#",
    "S": ".##|#..|.#.|..#|##.", "T": "###|.#.|.#.|.#.|.#.", "U": "#.#|#.#|#.#|#.#|###",
    "V": "#.#|#.#|#.#|#.#|.#.", "W": "#.#|#.#|###|###|#.#", "X": "#.#|#.#|.#.|#.#|#.#",
    "Y": "#.#|#.#|.#.|.#.|.#.", "Z": "###|..#|.#.|#..|###", "0": "###|#.#|#.#|#.#|###",
    "1": ".#.|##.|.#.|.#.|###", "2": "##.|..#|.#.|#..|###", "3": "##.|..#|.#.|..#|##.",
    "4": "#.#|#.#|###|..#|..#", "5": "###|#..|##.|..#|##.", "6": ".##|#..|###|#.#|###",
    "7": "###|..#|.#.|.#.|.#.", "8": "###|#.#|###|#.#|###", "9": "###|#.#|###|..#|##.",
    ".": "...|...|...|...|.#.", "-": "...|...|###|...|...", "/": "..#|..#|.#.|#..|#..",
    "_": "...|...|...|...|###", " ": "...|...|...|...|...", "(": ".#.|#..|#..|#..|.#.",
    ")": ".#.|..#|..#|..#|.#.", ":": "...|.#.|...|.#.|...", "=": "...|###|...|###|...",
    ",": "...|...|...|.#.|#..",
}
_FONT = {k: v.replace("|", "") for k, v in _FONT.items()}

COLORS = {"neptune_eq": (214, 39, 40), "sdpa": (31, 119, 180), "flex": (44, 160, 44),
          "compile": (148, 103, 189)}


class Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def dot(self, x: int, y: int, c, size: int = 1):
        for dx in range(size):
            for dy in range(size):
                xx, yy = x + dx, y + dy
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    i = (yy * self.w + xx) * 3
                    self.px[i:i + 3] = bytes(c)

    def line(self, x0, y0, x1, y1, c, width=2, dash=0):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            if dash and (k // dash) % 2:
                continue
            self.dot(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), c, width)

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 2):
        for ch in s.upper():
            g = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for col in range(3):
                    if g[r * 3 + col] == "#":
                        self.dot(x + col * scale, y + r * scale, c, scale)
            x += 4 * scale

    def png(self) -> bytes:
        return _png(self.w, self.h, self.px)


def _png(w: int, h: int, rgb: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + bytes(rgb[y * w * 3:(y + 1) * w * 3]) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def plot_op(op: str, rows: list[dict], title: str) -> bytes:
    """Throughput vs S (log axis) for one operator."""
    W, H, L, R, T, B = 720, 440, 90, 170, 50, 60
    cv = Canvas(W, H)
    rows = sorted(rows, key=lambda r: int(r["S"]))
    seqs = [int(r["S"]) for r in rows]
    series = {}
    for impl in COLORS:
        pts = [(int(r["S"]), _num(r.get(impl))) for r in rows]
        series[(impl, False)] = [(s, v) for s, v in pts if v is not None]
        g = [(int(r["S"]), _num(r.get(f"graph_{impl}"))) for r in rows]
        series[(impl, True)] = [(s, v) for s, v in g if v is not None]
    top = max([v for pts in series.values() for _, v in pts] or [1.0]) * 1.1
    lo, hi = math.log2(min(seqs)), math.log2(max(seqs))

    def X(s):
        return L + (0 if hi == lo else (math.log2(s) - lo) / (hi - lo)) * (W - L - R)

    def Y(v):
        return H - B - v / top * (H - T - B)
    grey, black = (210, 210, 210), (0, 0, 0)
    for k in range(6):  # y grid and ticks
        v = top * k / 5
        cv.line(L, round(Y(v)), W - R, round(Y(v)), grey, 1)
        cv.text(8, round(Y(v)) - 5, f"{v:.3g}" if v < 10 else f"{v:.0f}")
    for s in seqs:
        cv.line(round(X(s)), T, round(X(s)), H - B, grey, 1)
        cv.text(round(X(s)) - 4 * len(str(s)), H - B + 10, str(s))
    cv.line(L, H - B, W - R, H - B, black, 2)
    cv.line(L, T, L, H - B, black, 2)
    unit = rows[0].get("unit") or ""
    cv.text(L, 14, title)
    cv.text((W - R) // 2, H - 24, "S")
    cv.text(8, T - 22, unit)
    legend_y = T
    for (impl, graphed), pts in series.items():
        if not pts:
            continue
        c = COLORS[impl]
        dash = 6 if graphed else 0
        xy = [(round(X(s)), round(Y(v))) for s, v in pts]
        for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
            cv.line(x0, y0, x1, y1, c, 2, dash)
        for x, y in xy:
            cv.dot(x - 3, y - 3, c, 7)
        cv.line(W - R + 12, legend_y + 5, W - R + 36, legend_y + 5, c, 3, 4 if graphed else 0)
        cv.text(W - R + 42, legend_y, impl.replace("neptune_eq", "ours") + (" GRAPH" if graphed else ""),
                c)
        legend_y += 18
    return cv.png()


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
