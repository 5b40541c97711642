"""The persistent kernel cache (hit, miss, concurrent writers, corrupt and stale entries)
and the ``neptune-eq`` commands."""
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import neptune_eq as ne
from neptune_eq.choosing import cache
from neptune_eq.frontend import examples


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEPTUNE_EQ_CACHE", str(tmp_path))
    return tmp_path


def _entries(root: Path):
    return sorted((root / "winners").rglob("*.bin"))


def test_cache_miss_then_hit_then_miss_on_a_changed_shape(fresh_cache):
    first = ne.superoptimize(examples.softmax(3, 20), target="interpreter")
    again = ne.superoptimize(examples.softmax(3, 20), target="interpreter")
    other = ne.superoptimize(examples.softmax(3, 21), target="interpreter")
    assert (first.cache_status, again.cache_status, other.cache_status) == ("miss", "hit", "miss")
    assert again.build_seconds < 1.0 and again.source == first.source
    assert len(_entries(fresh_cache)) == 2
    x = torch.randn(3, 20)
    assert torch.allclose(again(x), torch.softmax(x, -1), atol=1e-5)


def test_a_hit_unpickles_what_only_explaining_reads_when_it_is_read(fresh_cache):
    """The trace, the e-graph and the candidates stay pickled in a loaded kernel until
    first read (a warm hit's time is the call's); read, they are what the build made."""
    first = ne.superoptimize(examples.softmax(3, 20), target="interpreter")
    again = ne.superoptimize(examples.softmax(3, 20), target="interpreter")
    assert again.cache_status == "hit"
    assert set(again.__dict__["_lazy"]) == {"trace", "candidates", "_egraph_json", "_egraph_dot"}
    assert "trace" not in again.__dict__
    assert again.explain() == first.explain()  # reads the trace and the candidates
    assert "trace" in again.__dict__ and "trace" not in again.__dict__["_lazy"]
    assert again.candidate_table() == first.candidate_table()
    with pytest.raises(AttributeError):
        again.no_such_field


def test_corrupted_entry_is_detected_and_rebuilt(fresh_cache):
    ne.superoptimize(examples.softmax(2, 9), target="interpreter")
    (entry,) = _entries(fresh_cache)
    data = bytearray(entry.read_bytes())
    data[-20] ^= 0xFF  # flip a byte of the payload
    entry.write_bytes(bytes(data))
    k = ne.superoptimize(examples.softmax(2, 9), target="interpreter")
    assert k.cache_status == "corrupt entry rebuilt"
    entry.write_bytes(b"garbage")
    assert ne.superoptimize(examples.softmax(2, 9), target="interpreter").cache_status == \
        "corrupt entry rebuilt"
    assert ne.superoptimize(examples.softmax(2, 9), target="interpreter").cache_status == "hit"


def test_a_changed_code_generator_is_a_new_key_never_an_old_entry(fresh_cache, monkeypatch):
    """Entries cannot be stale: the key holds a hash of the package's source (and of the
    rules and library versions), so changed code misses instead of reusing old kernels."""
    assert ne.superoptimize(examples.softmax(2, 7), target="interpreter").cache_status == "miss"
    assert ne.superoptimize(examples.softmax(2, 7), target="interpreter").cache_status == "hit"
    real = cache._versions()
    monkeypatch.setattr(cache, "_versions", lambda: {**real, "neptune_eq": "edited-source"})
    assert ne.superoptimize(examples.softmax(2, 7), target="interpreter").cache_status == "miss"
    assert len(_entries(fresh_cache)) == 2


def _worker(args):
    root, n = args
    os.environ["NEPTUNE_EQ_CACHE"] = root
    import neptune_eq as ne2
    from neptune_eq.frontend import examples as ex
    k = ne2.superoptimize(ex.softmax(4, n), target="interpreter")
    return k.cache_status


def test_a_flipped_lowering_switch_is_a_new_key(fresh_cache, monkeypatch):
    """The benches flip the Gluon walk's module switches to A/B them in one process: an
    entry chosen under one setting must not serve the other."""
    from neptune_eq.lowering import gluon_sums, gluon_tiles, gluon_ws
    assert ne.superoptimize(examples.softmax(2, 5), target="interpreter").cache_status == "miss"
    for module, switch in ((gluon_ws, "PERSISTENT"), (gluon_ws, "SCHEDULED"),
                           (gluon_ws, "DYNAMIC"), (gluon_ws, "DYNAMIC_TIMED"),
                           (gluon_tiles, "DYNAMIC_HEADS_FIRST"), (gluon_sums, "PERSISTENT")):
        with monkeypatch.context() as m:
            m.setattr(module, switch, not getattr(module, switch))
            assert ne.superoptimize(examples.softmax(2, 5),
                                    target="interpreter").cache_status == "miss"
    assert ne.superoptimize(examples.softmax(2, 5), target="interpreter").cache_status == "hit"


def test_concurrent_writers_leave_one_valid_entry(fresh_cache):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        statuses = pool.map(_worker, [(str(fresh_cache), 11)] * 4)
    assert set(statuses) <= {"miss", "hit"}
    (entry,) = _entries(fresh_cache)
    assert not list((fresh_cache / "winners").rglob(".tmp-*"))  # no half-written leftovers
    assert ne.superoptimize(examples.softmax(4, 11), target="interpreter").cache_status == "hit"


def _cli(*args, cwd=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "neptune_eq", *args], capture_output=True,
                          text=True, env=env, cwd=cwd)


def test_cli_optimize_from_flags_and_file_and_svg(tmp_path):
    r = _cli("optimize", "--causal", "--softcap", "20", "--seq-q", "1", "--seq-kv", "40",
             "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--no-cache",
             "--svg", str(tmp_path / "e.svg"))
    assert r.returncode == 0, r.stderr
    for part in ("== rewrite trace", "== candidates", "<- chosen", "@triton.jit", "split-k"):
        assert part in r.stdout
    assert (tmp_path / "e.svg").read_text().startswith("<svg")
    prog = tmp_path / "lse.py"
    prog.write_text("import neptune_eq as ne\n"
                    "def program():\n"
                    "    return ne.build_program  # wrong: not the outputs\n")
    bad = _cli("optimize", "--file", str(prog), "--no-cache")
    assert bad.returncode != 0
    r = _cli("optimize", "--file", str(tmp_path / "missing.py"))
    assert r.returncode != 0 and "no such file" in r.stderr


def test_cli_explain_and_bench_without_gpu():
    r = _cli("explain", "--seq-q", "8", "--seq-kv", "24", "--head-dim", "16", "--no-cache")
    assert r.returncode == 0 and "derivation" in r.stdout and "rolling-sum" in r.stdout
    r = _cli("bench", "--no-cache")
    assert r.returncode == 2 and "GPU" in r.stderr
