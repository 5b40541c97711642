"""bench/plot.py: the hand-written PNG encoder and the per-operator plot."""
import struct
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot  # noqa: E402


def _decode(png: bytes):
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", png[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + data)
        chunks[kind] = data
        pos += 12 + n
    w, h = struct.unpack(">II", chunks[b"IHDR"][:8])
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    return w, h, raw


def test_plot_draws_every_series_into_a_valid_png():
    rows = [{"op": "causal-dc", "S": s, "unit": "TB/s", "neptune_eq": v, "sdpa": v * 1.1,
             "flex": "failed: X", "graph_neptune_eq": v * 1.3} for s, v in ((512, 0.5), (2048, 1.5))]
    w, h, raw = _decode(plot.plot_op("causal-dc", rows, "causal-dc on test"))
    pixels = {raw[y * (1 + 3 * w) + 1 + 3 * x:y * (1 + 3 * w) + 4 + 3 * x]
              for y in range(h) for x in range(0, w, 2)}
    assert bytes(plot.COLORS["neptune_eq"]) in pixels and bytes(plot.COLORS["sdpa"]) in pixels
    assert bytes(plot.COLORS["flex"]) not in pixels  # a failed peer draws nothing
