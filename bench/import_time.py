"""Import cost of neptune_eq over torch (issue 13: at most 0.3 s more than `import torch`).

Each sample is a fresh interpreter, so nothing is warm in sys.modules; the OS file cache
is warmed by one untimed run of each.  Writes bench/results/import_time.json.

    python bench/import_time.py [--samples 10]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
         "{extra}; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")


def sample(extra: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(extra=extra)], check=True,
                         capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=10)
    args = ap.parse_args()
    sample("import neptune_eq")  # warm the file cache
    torch_s, over_s = zip(*(sample("import neptune_eq") for _ in range(args.samples)))
    result = {"python": platform.python_version(), "machine": platform.machine(),
              "samples": args.samples,
              "import_torch_s_median": statistics.median(torch_s),
              "import_neptune_eq_after_torch_s_median": statistics.median(over_s),
              "import_neptune_eq_after_torch_s_max": max(over_s)}
    out = Path(__file__).parent / "results" / "import_time.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
