"""bench/plot.py: the per-operator plot (matplotlib)."""
import sys

import pytest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plot  # noqa: E402


ROWS = [{"op": "causal-dc", "S": s, "unit": "TB/s", "neptune_eq": v, "sdpa": v * 1.1,
         "flex": "failed: X", "graph_neptune_eq": v * 1.3} for s, v in ((512, 0.5), (2048, 1.5))]


def test_series_keeps_measured_points_and_drops_failures():
    got = plot.series(ROWS)
    assert got[("neptune_eq", False)] == [(512, 0.5), (2048, 1.5)]
    assert [s for s, _ in got[("neptune_eq", True)]] == [512, 2048]
    assert [v for _, v in got[("neptune_eq", True)]] == pytest.approx([0.65, 1.95])
    assert ("flex", False) not in got and ("sdpa", True) not in got


def test_plot_draws_a_png_with_every_series_in_its_colour():
    import io

    import matplotlib.image as mpimg
    png = plot.plot_op("causal-dc", ROWS, "causal-dc on test")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = (mpimg.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    colours = {tuple(p) for p in img.reshape(-1, 3)}

    def rgb(hexc):
        return tuple(int(hexc[k:k + 2], 16) for k in (1, 3, 5))
    assert rgb(plot.COLORS["neptune_eq"]) in colours and rgb(plot.COLORS["sdpa"]) in colours
    assert rgb(plot.COLORS["flex"]) not in colours  # a failed peer draws nothing
