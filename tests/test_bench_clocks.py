"""bench/gpu_clocks.py: nvidia-smi's samples parsed into the clock state a GPU timing
is reported with (the power cap set jagged attention's speed at S=32768, session 49)."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_clocks  # noqa: E402


class _FakeSmi:
    """nvidia-smi -lms's csv lines, as the real one prints them, header and a cut line too."""
    def __init__(self, *a, **k):
        import io
        self.stdout = io.StringIO("1980, 120.00, 0x0000000000000000\n")  # before the block


    def terminate(self):
        pass

    def communicate(self):
        return ("1980, 330.14, 0x0000000000000000\n"
                "1515, 680.26, 0x0000000000000004\n"
                "1800, 675.52, 0x0000000000000004\n"
                "1650, 684.97, 0x0000000000000024\n"
                "[N/A], [N/A], [N/A]\n"
                "17", None)


def test_samples_give_clock_power_and_the_power_capped_share(monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _FakeSmi)
    with gpu_clocks.sampled_clocks() as c:
        pass
    s = c.summary()
    assert s["clock_samples"] == 4
    assert s["clock_mhz_min"] == 1515 and s["clock_mhz_median"] == (1650 + 1800) / 2
    assert s["power_w_max"] == 684.97
    assert s["power_capped_share"] == 0.75 and s["thermal_share"] == 0.25


def test_without_nvidia_smi_the_block_runs_and_the_summary_says_why(monkeypatch):
    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(subprocess, "Popen", missing)
    ran = False
    with gpu_clocks.sampled_clocks() as c:
        ran = True
    assert ran and "nvidia-smi not run" in c.summary()["clock_note"]
