"""The GPU's SM clock, board power and throttle reasons sampled while a block of code runs
(``nvidia-smi`` every 100 ms in the background).

A long tensor-core kernel can run into the board's power limit: on an H200 at S=32768
the jagged-document call drew 660-690 W with the software power cap active (throttle
reason 0x4) and the SM clock at 1515-1905 of 1980 MHz, and the same machine code read
1.545-1.782 ms per call across sessions and machines (bench/results/README.md, session
49).  A timing at such sizes is only comparable with its clock state beside it:

    with sampled_clocks() as clocks:
        ms = do_bench(call)
    row.update(clocks.summary())

Where ``nvidia-smi`` is missing the summary says so and the block runs unchanged.
"""
from __future__ import annotations

import statistics
import subprocess

# nvidia-smi's clocks_throttle_reasons.active bits
POWER_CAP = 0x4          # software power cap
HW_SLOWDOWN = 0x8        # hardware slowdown (thermal or power brake)
THERMAL = 0x20 | 0x40    # software and hardware thermal slowdown


class sampled_clocks:
    """Context manager: samples while the block runs; ``summary()`` afterwards."""

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, int]] = []  # (MHz, W, throttle bits)
        self.error = ""

    def __enter__(self):
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.period_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as e:
            self._proc, self.error = None, f"nvidia-smi not run: {e}"
            return self
        # nvidia-smi takes about a second to start: wait for its first sample, so that the
        # block's samples are the block's (that one, taken before it, is left out)
        self._proc.stdout.readline()
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        out = self._proc.communicate()[0]
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
            except (ValueError, IndexError):
                continue  # a header, a cut line, "[N/A]"
        return False

    def summary(self) -> dict:
        """Median and lowest SM clock (MHz), median and highest power (W), and the share of
        samples under the power cap or any thermal slowdown.  One sample per 100 ms: a
        block as short as ``do_bench``'s default 100 ms gets one or two."""
        if not self.samples:
            return {"clock_note": self.error or "no nvidia-smi samples (the block ran < 100 ms?)"}
        mhz, watts, bits = zip(*self.samples)
        n = len(bits)
        return {"clock_mhz_median": statistics.median(mhz), "clock_mhz_min": min(mhz),
                "power_w_median": statistics.median(watts), "power_w_max": max(watts),
                "power_capped_share": round(sum(b & POWER_CAP != 0 for b in bits) / n, 2),
                "thermal_share": round(sum(b & (THERMAL | HW_SLOWDOWN) != 0 for b in bits) / n, 2),
                "clock_samples": n}
