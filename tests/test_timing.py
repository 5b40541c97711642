"""How a candidate config is timed (``runtime.timing``, ``runtime.tuning``): a long call
from the host in a few runs, a short one by ``do_bench``; a short Gluon config charged its
host path only where that bounds the call.  (Moved out of ``test_bound_call.py``.)"""
import torch


def test_host_timing_runs_a_long_call_three_times_and_a_short_one_by_do_bench(monkeypatch):
    """``timing.host_ms``: a call of ``LONG_CALL_MS`` or more is timed in
    ``LONG_CALL_SAMPLES`` runs (the median; the first run counts), a shorter one by
    ``do_bench``'s budgets -- each run after an L2 flush."""
    import triton.testing
    from neptune_eq.runtime import timing
    clock = {"ms": 0.0, "runs": [], "flushes": 0}

    class Event:  # elapsed time = what the call under test "took"
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    class Flush:
        def zero_(self):
            clock["flushes"] += 1
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: Flush())
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **k: ("do_bench", k))

    def call_taking(times):
        def call():
            clock["ms"] += times[len(clock["runs"]) % len(times)]
            clock["runs"].append(1)
        return call
    assert timing.host_ms(call_taking([9.0, 7.0, 8.5])) == 8.5   # the median of three runs
    assert len(clock["runs"]) == timing.LONG_CALL_SAMPLES == clock["flushes"] == 3
    clock["runs"].clear()
    assert timing.host_ms(call_taking([0.2])) == ("do_bench", {"warmup": 10, "rep": 40,
                                                              "return_mode": "median"})


def test_a_short_gluon_config_is_charged_its_host_path_only_where_it_bounds_the_call():
    """Short calls time every config on the GPU alone; a Gluon config's own launch path is
    charged only where the call from the host takes over ``HOST_SLACK`` times that and
    the reference tl config's call from the host."""
    from neptune_eq.runtime.tuning import HOST_SLACK, gluon_short_ms
    assert gluon_short_ms(0.020, 0.0243) == 0.020          # GQA S=512: the GPU's time
    assert gluon_short_ms(0.010, 0.300) == 0.300           # a host-bound launch path
    assert gluon_short_ms(0.010, HOST_SLACK * 0.010) == 0.010
    # a launch path no slower than the tl reference's: the host's jitter on a call whose
    # every form takes ~2x its GPU time from the host is nobody's cost (jagged, 4096 keys)
    assert gluon_short_ms(0.045, 0.0845, reference_host_ms=0.080) == 0.045
    assert gluon_short_ms(0.010, 0.300, reference_host_ms=0.030) == 0.300
