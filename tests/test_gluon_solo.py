"""The one-consumer Gluon form and the heads-first launch order (lowering/gluon_ws.py).

The interpreter cannot run Gluon, so the forms are compiled for sm_90 on CPU
(``sm90_compile.py``: PTX and cubin, registers and spills from ptxas) and their tile
decode is run in Python; their numbers are checked on the GPU by
bench/gluon_probe/solo_form.py (every Gluon config against a ``tl`` run).
"""
import threading

import pytest
import torch

import neptune_eq as ne
from sm90_compile import compile_for_sm90
from neptune_eq.lowering import gluon_form, gluon_tiles, gluon_ws
from neptune_eq.runtime import gluon_launch, tile_configs
from neptune_eq.runtime.gluon_launch import make_launcher, sm90_spec
from neptune_eq.runtime.launcher import import_source
from neptune_eq.runtime.tile_configs import TileConfig

IDS = torch.tensor([0] * 40 + [1] * 60 + [2] * 100, dtype=torch.int32)


@pytest.fixture(autouse=True)
def _solo_on(monkeypatch):
    """The one-consumer form is generated only with ``gluon_ws.SOLO`` (on by default;
    ``NEPTUNE_EQ_GLUON_SOLO=0`` turns it off)."""
    monkeypatch.setattr(gluon_ws, "SOLO", True)


def _documents(d: int):
    return ne.superoptimize(ne.attention(1, 2, 200, 200, d, "float16",
                                         mask_mod=lambda b, h, q, kv: (IDS[q] == IDS[kv]) & (q >= kv)),
                            target="interpreter", cache=False)


@pytest.mark.parametrize("d, key_block, programs", [(128, 64, 2), (64, 64, 3), (64, 128, 2)])
def test_the_one_consumer_form_fits_two_or_three_programs_an_sm(tmp_path, d, key_block, programs):
    """A data mask's form comes with a one-consumer form: 64-row programs, one consumer
    warpgroup and the producer warp, launched at the register share that lets an SM hold
    ``programs`` of them -- and ptxas compiles the consumer there without spilling."""
    kern = _documents(d)
    solo = kern.kernel_source.gluon.solo
    assert solo.consumers == 1 and solo.rows == 64 and solo.solo is None
    src = solo.source
    assert src.count("(_consumer, (") == 1 and "], [1], [24])" in src
    assert "allocate_shared_memory(DTYPE, [1, 64, D]" in src
    assert "mbarrier.init(q_empty, count=1)" in src
    assert solo.programs_per_sm(key_block) == programs
    maxnreg = solo.options(key_block)["maxnreg"]
    assert maxnreg * 256 * programs <= gluon_form.SM_REGS
    path = tmp_path / "solo.py"
    path.write_text(src)
    spec = {**sm90_spec(kern.program, kern.kernel_source, 2, key_block, form=solo),
            "resources": True}
    res = compile_for_sm90(path, solo.name, spec)
    assert res["ok"], res["error"]
    assert res["tma"] and res["wgmma"] and res["setmaxnreg"], res
    assert res["registers"] <= maxnreg and res["spill_stores"] == 0, res
    assert programs * (res["shared"] + 1024) <= gluon_form.SM_SMEM, res


def test_only_data_masks_get_the_one_consumer_form(monkeypatch):
    """It wins only there (bench/results/README.md, sessions 37-38): elsewhere its compile
    would only lengthen a cold build.  Off (``SOLO``), no form has one, and the data
    masks' configs are the two-consumer form's."""
    causal = ne.superoptimize(ne.attention(1, 2, 200, 200, 64, "float16",
                                           mask_mod=lambda b, h, q, kv: q >= kv),
                              target="interpreter", cache=False)
    assert causal.kernel_source.gluon is not None and causal.kernel_source.gluon.solo is None
    assert _documents(64).kernel_source.gluon.solo is not None
    monkeypatch.setattr(gluon_ws, "SOLO", False)
    assert _documents(64).kernel_source.gluon.solo is None
    monkeypatch.setattr(tile_configs, "gluon_unavailable", lambda: None)
    docs = tile_configs.candidate_configs(_documents(128).kernel_source, "cuda")
    assert not any(c.blocks.get("B_i") == 64 for c in docs if c.gluon_ws)


class _Int(int):
    """A scalar as the decode's Gluon code uses one (``.to(dtype)``)."""
    def to(self, _dtype):
        return _Int(int(self))

    def __ne__(self, other):
        return _Int(int(self) != int(other))

    __hash__ = int.__hash__


class _Gl:
    """The few ``gl`` calls of ``grid_order``'s lines, for one program of a grid."""
    int32 = "int32"

    def __init__(self, grid, pid):
        self.grid, self.pid = grid, pid

    def cdiv(self, a, b):
        return -(-a // b)

    def num_programs(self, axis):
        return _Int(self.grid[axis])

    def program_id(self, axis):
        return _Int(self.pid[axis])


@pytest.mark.parametrize("rows, heads", [(200, 3), (256, 4), (64, 7), (130, 1)])
def test_either_grid_order_runs_every_tile_once(rows, heads):
    """The kernel reads its grid's order off the grid's shape, so one compiled kernel runs
    both launch orders -- every (row block, head) once, the same tiles when the row
    blocks and heads are as many."""
    ids = torch.arange(rows, dtype=torch.int32) // 50
    kern = ne.superoptimize(ne.attention(1, heads, rows, rows, 64, "float16",
                                         mask_mod=lambda b, h, q, kv: ids[q] == ids[kv]),
                            target="interpreter", cache=False)
    lines = gluon_tiles.grid_order(kern.plan, 128)
    n_rb = -(-rows // 128)
    for grid in ((n_rb, heads), (heads, n_rb)):
        seen = []
        for a in range(grid[0]):
            for b in range(grid[1]):
                env = {"gl": _Gl(grid, (a, b))}
                exec("\n".join(ln.strip() for ln in lines), env)
                seen.append((int(env["row_block"]), int(env["pid_grid"])))
        assert sorted(seen) == [(r, h) for r in range(n_rb) for h in range(heads)], grid
    src = kern.kernel_source.gluon.source
    assert "hf = (gl.num_programs(0) != n_rb)" in src and kern.kernel_source.gluon.heads_first_ok


def test_heads_first_on_a_form_that_walks_its_tiles_is_a_clear_error(monkeypatch):
    """A persistent form decodes one grid: heads first is no launch order of it."""
    monkeypatch.setattr(gluon_launch, "gluon_unavailable", lambda: None)
    kern = ne.superoptimize(ne.attention(1, 2, 200, 200, 64, "float16"), target="interpreter",
                            cache=False)
    assert kern.kernel_source.gluon.persistent and not kern.kernel_source.gluon.heads_first_ok
    cfg = TileConfig({"B_i": 128, "B_L": 128}, 4, 2, gluon_ws=True, heads_first=True)
    with pytest.raises(ValueError, match="heads first is a launch order"):
        make_launcher(kern.program, kern.kernel_source, "cuda", cfg)
    assert "heads-first" in str(cfg) and cfg.as_dict()["heads_first"]


def test_a_module_imported_from_many_threads_at_once_is_imported_once():
    """The timer compiles configs on a thread pool; two configs of one module (ring
    depths, key blocks) once raced on one temporary file (a GPU probe's solo configs
    failed with 'No such file or directory')."""
    source = f"# {threading.get_ident()} {id(object())}\nVALUE = 7\n\ndef kernel():\n    return VALUE\n"
    got, errors = [], []

    def one():
        try:
            got.append(import_source(source, "thread_probe", ["kernel"], interpret=False)[0])
        except Exception as e:  # noqa: BLE001 - the assertion below names it
            errors.append(e)
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len({id(f) for f in got}) == 1 and got[0]() == 7
