"""bench/doc_decode_gpu.py: its CPU path (the document-mask decode it times, through the
interpreter, against SDPA with the mask as a boolean tensor) and the table it writes."""
import json
import sys
from pathlib import Path

import pytest
import neptune_eq  # noqa: E402,F401  (first: it picks the Triton interpreter without a GPU)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
pytest.importorskip("triton")
import doc_decode_gpu as dd  # noqa: E402


def test_the_bench_s_decode_matches_sdpa_on_cpu(monkeypatch):
    monkeypatch.setattr(dd, "HQ", dd.HQ)  # smoke() shrinks the heads: restore them after
    monkeypatch.setattr(dd, "HKV", dd.HKV)
    monkeypatch.setattr(dd, "D", dd.D)
    dd.smoke()  # raises SystemExit past 1e-4


def test_the_table_reports_ratios_and_a_wrong_row_as_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(dd, "RESULTS", tmp_path)
    monkeypatch.setattr(dd.torch.cuda, "get_device_name", lambda: "GPU")
    good = {"S": 8192, "B": 1, "docs": 13, "dtype": "float16", "visible_keys": 1189,
            "us_ours_graphed": 9.6, "us_ours_nomask_graphed": 12.7, "x_flex_prebuilt_graphed": 1.84,
            "x_sdpa_graphed": 2.14, "us_ours_called": 14.6, "x_flex_prebuilt_called": 3.63,
            "x_flex_percall_called": 367.0, "x_sdpa_called": 2.42, "config": "B_L=64 splits=16"}
    bad = {"S": 8192, "docs": 1, "dtype": "float16", "visible_keys": 8192,
           "max_abs_diff_vs_sdpa": {"ours": 0.5}, "error": "differs from SDPA"}
    dd.write([good, bad], "t")
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[-2].startswith("| 8192 | 1 | 13 | float16 | 1189 | 9.60 | 12.70 | 1.84 | 2.14 | 14.60 |")
    assert "differs from SDPA" in md[-1] and "9.60" not in md[-1]
    assert json.loads((tmp_path / "t.json").read_text())["rows"][1]["error"] == "differs from SDPA"
