"""bench/interleaved_ratio.py: rounds of timings summarised into the ratio's spread, and
the table it writes (the GPU part needs a GPU; this is its arithmetic and its report)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
pytest.importorskip("triton")
import interleaved_ratio as ir  # noqa: E402


def test_each_round_is_ours_over_that_rounds_best_peer():
    rounds = [{"neptune_eq": 1.0, "sdpa": 1.1, "flex": 0.5},   # 1/1.1
              {"neptune_eq": 1.2, "sdpa": 1.0, "flex": 1.5},   # the best peer changes: 1.2/1.5
              {"neptune_eq": 1.0, "sdpa": 0.8, "flex": 0.4}]   # 1.25
    s = ir.summarise(rounds)
    assert s["ratios"] == pytest.approx([1 / 1.1, 0.8, 1.25])
    assert s["median"] == pytest.approx(1 / 1.1) and s["low"] == pytest.approx(0.8)
    assert s["high"] == pytest.approx(1.25) and s["below_one"] == 2
    assert s["ours"] == 1.0 and s["sdpa"] == 1.0 and s["flex"] == 0.5  # medians of speeds


def test_without_a_peer_only_speeds_are_reported():
    s = ir.summarise([{"neptune_eq": 2.0}, {"neptune_eq": 3.0}])
    assert s == {"ours": 2.5, "ratios": []}


def test_the_table_names_the_best_peer_and_the_spread(tmp_path):
    rounds = [{"neptune_eq": 3.5, "sdpa": 3.6}, {"neptune_eq": 3.7, "sdpa": 3.6}]
    row = {"setup": "gqa-dc S=32768", "unit": "TB/s", "config": "B_L=128", "peers": ["sdpa"],
           "rounds": 2, "dram": ir.summarise(rounds)}
    meta = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "date": "2026-11-29",
            "command": "python bench/interleaved_ratio.py --ops gqa-dc"}
    ir.write(tmp_path, [row], meta)
    md = (tmp_path / "interleaved_ratio.md").read_text()
    assert "| gqa-dc S=32768 | dram | 3.60 TB/s | sdpa 3.60 | 1.000 | 0.972 | 1.028 | 1/2 | B_L=128 |" in md
    assert json.loads((tmp_path / "interleaved_ratio.json").read_text())["rows"][0]["dram"]["below_one"] == 1
