"""The summary pre-pass (lowering.summary_kernel + runtime.block_summary): ONE launch
computes every per-block [min, max] and global [min, max, nondecreasing] summary a kernel
reads, bit-identical to the torch reference ``summarize`` -- odd sizes, several block
sizes at once, int / float / bool data (NaN and inf included), non-contiguous tensors,
and one compiled pre-pass reused at other sizes (symbolic sizes are runtime arguments)."""
import importlib.util
import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import neptune_eq  # noqa: F401 - chooses the Triton interpreter before triton is imported
from neptune_eq.lowering.block_predicate import SummarySpec
from neptune_eq.lowering.data_indices import IdCheck
from neptune_eq.lowering.summary_kernel import CHUNK, NUM_WARPS, prepass_source
from neptune_eq.runtime.block_summary import SummaryPrepass, summarize
from neptune_eq.runtime.triton_mode import enable_interpreter

_MODULES: dict[str, object] = {}
BIAS_IDS = IdCheck("doc", 4, "bias", (None,))  # bias[doc[q]]: doc read whole, 4 entries


def compile_prepass(specs, dtypes: dict, ranks: dict, tmp_path_factory):
    """The generated pre-pass, imported as Triton needs it (from a file)."""
    text, pre = prepass_source("t", specs, dtypes.__getitem__, ranks.__getitem__)
    return _compile_text(text, pre, tmp_path_factory)


def run(fn, pre, tensors: dict, consts: dict) -> dict:
    drv = SummaryPrepass(pre, consts, fn)
    outs, launch, args, ints = drv.prepare(tensors)
    launch.fn[launch.grid](*args, *ints, **launch.consts, **launch.options)
    return outs


def check(specs, tensors: dict, consts: dict, tmp_path_factory):
    dtypes = {n: str(t.dtype).replace("torch.", "") for n, t in tensors.items()}
    ranks = {n: t.dim() for n, t in tensors.items()}
    fn, pre, _ = compile_prepass(specs, dtypes, ranks, tmp_path_factory)
    got = run(fn, pre, tensors, consts)
    for s in specs:
        want = summarize(tensors[s.tensor], s.dim, consts[s.block] if s.block else 1)
        assert got[s.name].dtype == want.dtype and got[s.name].shape == want.shape, s
        g, w = got[s.name], want
        if g.is_floating_point():  # a NaN is a NaN (torch's payload differs by path)
            assert torch.equal(g.isnan(), w.isnan()), (s, g, w)
            g, w = g.nan_to_num(0.0, float("inf"), -float("inf")), w.nan_to_num(0.0, float("inf"), -float("inf"))
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (s, got[s.name], want)


def doc_specs(t="doc"):
    """What a causal document mask reads: row blocks, key blocks, the global summary."""
    return [SummarySpec(f"bs_{t}_d0_row", t, 0, "B_i"), SummarySpec(f"bs_{t}_d0_loop", t, 0, "B_L"),
            SummarySpec(f"bs_{t}_all", t, None, None)]


def test_one_kernel_one_launch_for_every_summary(tmp_path_factory):
    specs = doc_specs()
    _, pre, text = compile_prepass(specs, {"doc": "int32"}, {"doc": 1}, tmp_path_factory)
    assert text.count("@triton.jit") == 1 and pre.kernel == "t_summaries"
    drv = SummaryPrepass(pre, {"B_i": 16, "B_L": 32}, None)
    _, launch, _, ints = drv.prepare({"doc": torch.zeros(1000, dtype=torch.int32)})
    # 63 row blocks (4 per program of 2048 // 16 = 128 blocks: 1 program), 32 key blocks
    # (1 program), the global walk (1 program)
    assert launch.grid == (3, 1, 1) and ints[-2:] == [1, 2]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 53, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_document_summaries_match_torch(n, dtype, tmp_path_factory):
    g = torch.Generator().manual_seed(n)
    ids = torch.sort(torch.randint(-1, 9, (n,), generator=g)).values.to(dtype)
    check(doc_specs(), {"doc": ids}, {"B_i": 16, "B_L": 64}, tmp_path_factory)
    shuffled = ids[torch.randperm(n, generator=g)]   # the flag must go off
    check(doc_specs(), {"doc": shuffled}, {"B_i": 128, "B_L": 16}, tmp_path_factory)


@pytest.mark.parametrize("n", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3])
def test_global_walk_over_several_steps(n, tmp_path_factory):
    """The whole-tensor walk loads step k+1 before it reduces step k: every step's min,
    max and order count, and so does the pair across each step's boundary -- one
    descent placed exactly there, or at the very end, turns the flag off."""
    ids = torch.arange(n, dtype=torch.int32) // 97
    spec = [SummarySpec("bs_doc_all", "doc", None, None)]
    check(spec, {"doc": ids}, {}, tmp_path_factory)
    for at in sorted({CHUNK, n - 1} & set(range(1, n))):
        down = ids.clone()
        down[at] = down[at - 1] - 1
        got = run(*compile_prepass(spec, {"doc": "int32"}, {"doc": 1}, tmp_path_factory)[:2],
                  {"doc": down}, {})["bs_doc_all"]
        assert got.tolist() == summarize(down, None, 1).tolist() and got[2] == 0, (at, got)
    wide = torch.randint(-50, 50, (3, CHUNK // 2 + 5), dtype=torch.int64).t()  # 2-D, strided
    check([SummarySpec("bs_w_all", "w", None, None)], {"w": wide}, {}, tmp_path_factory)


def test_float_summaries_propagate_nan_and_keep_inf(tmp_path_factory):
    x = torch.linspace(-3, 3, 77)
    x[5] = float("nan")
    x[40] = float("inf")
    x[70] = -float("inf")
    check(doc_specs("x"), {"x": x}, {"B_i": 16, "B_L": 32}, tmp_path_factory)
    check(doc_specs("x"), {"x": torch.linspace(-3, 3, 77)}, {"B_i": 16, "B_L": 32},
          tmp_path_factory)


def test_bool_and_multi_dim_summaries(tmp_path_factory):
    """A (heads, keys) keep table along dim 1, a per-sample id table along dim 1 of a
    transposed (non-contiguous) tensor and along dim 0, a bool table and global summaries
    of 2-D tensors (never flagged nondecreasing)."""
    g = torch.Generator().manual_seed(0)
    keep = torch.randint(0, 2, (3, 70), generator=g, dtype=torch.int32)
    bdoc = torch.randint(0, 5, (45, 2), generator=g).t()    # (2, 45), strides (1, 2)
    allowed = torch.randint(0, 2, (5, 7), generator=g).bool()
    specs = [SummarySpec("bs_keep_d1_loop", "keep", 1, "B_L"),
             SummarySpec("bs_bdoc_d1_row", "bdoc", 1, "B_i"),
             SummarySpec("bs_bdoc_d0_loop", "bdoc", 0, "B_L"),
             SummarySpec("bs_allowed_d1_loop", "allowed", 1, "B_L"),
             SummarySpec("bs_allowed_all", "allowed", None, None),
             SummarySpec("bs_bdoc_all", "bdoc", None, None)]
    check(specs, {"keep": keep, "bdoc": bdoc, "allowed": allowed}, {"B_i": 16, "B_L": 32},
          tmp_path_factory)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.sampled_from([16, 32, 64, 128]), st.sampled_from([16, 64]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_one_compiled_prepass_serves_every_size(n, bi, bl, sort, seed):
    """Sizes and strides are runtime arguments: the same module (symbolic sizes) at any
    length and any pair of block sizes, against torch."""
    import tempfile
    from pathlib import Path

    class Factory:  # hypothesis does not mix with function-scoped pytest fixtures
        def mktemp(self, name):
            return Path(tempfile.mkdtemp(prefix=name))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (n,), generator=g, dtype=torch.int32)
    if sort:
        ids = torch.sort(ids).values
    check(doc_specs(), {"doc": ids}, {"B_i": bi, "B_L": bl}, Factory())


def test_empty_captured_tensor_is_a_clear_error(tmp_path_factory):
    fn, pre, _ = compile_prepass(doc_specs(), {"doc": "int32"}, {"doc": 1}, tmp_path_factory)
    with pytest.raises(ValueError, match="is empty"):
        run(fn, pre, {"doc": torch.zeros(0, dtype=torch.int32)}, {"B_i": 16, "B_L": 16})


def test_prepass_with_several_summaries_compiles_for_sm90(tmp_path):
    """Block and whole-tensor summaries are branches of one ``if`` on the program id; their
    locals differ in type (a tile of blocks vs a scalar), which Triton's compiler refuses
    in a shared name ("Mismatched type for first between then block and else block", met
    on an H100 with Triton 3.6).  Compiled here for sm_90 without a GPU."""
    specs = [SummarySpec("bs_doc_i", "doc", 0, "B_i"), SummarySpec("bs_doc_L", "doc", 0, "B_L"),
             SummarySpec("bs_doc_all", "doc", None, None)]
    text, _ = prepass_source("t", specs, {"doc": "int32"}.__getitem__, {"doc": 1}.__getitem__)
    res = compile_prepass_for_sm90(tmp_path, text)
    assert res["ok"], res


def compile_prepass_for_sm90(tmp_path, text: str, options: dict | None = None) -> dict:
    """``sm90_compile``'s line for pre-pass ``t_summaries`` (int32 tensors, blocks of 32)."""
    from sm90_compile import compile_for_sm90
    path = tmp_path / "prepass_sm90.py"
    path.write_text("import triton\nimport triton.language as tl\n" + text)
    kernel = re.search(r"def (t_\w+)\(", text).group(1)
    params = text.split(f"def {kernel}(")[1].split("):")[0]
    names = [p.strip().split(":")[0] for p in params.split(",") if p.strip()]
    spec = {"dtypes": {n: "*i32" for n in names if n.endswith("_ptr")},
            "constexprs": {n: 32 for n in names if "constexpr" in params.split(n, 1)[1].split(",")[0]},
            "num_warps": NUM_WARPS, "num_stages": 1, "options": options or {}}
    return compile_for_sm90(path, kernel, spec, timeout=300)


def test_prepass_asserts_ids_in_range_on_the_device(tmp_path):
    """A tensor whose entries index a table (doc in offsets[doc[q]]): its summaries assert
    -n <= id < n on the device, and the launch compiles asserts in (``debug``, without
    Triton's overflow checks of every integer op).  Compiled here for sm_90 without a GPU
    (the interpreter does not run device asserts; CPU calls check on the host,
    ``runtime.index_check``)."""
    from neptune_eq.runtime.block_summary import SummaryPrepass
    specs = [SummarySpec("bs_doc_i", "doc", 0, "B_i"), SummarySpec("bs_doc_all", "doc", None, None)]
    text, pre = prepass_source("t", specs, {"doc": "int32"}.__getitem__, {"doc": 1}.__getitem__,
                               ids=[IdCheck("doc", 14, "offsets", (None,))])
    assert pre.checks and text.count("tl.device_assert(") == 2
    assert "outside [-14, 14)" in text and "(blk_0 >= nb_0)" in text  # padding blocks pass
    options = SummaryPrepass(pre, {"B_i": 16}, None).options
    assert options["debug"] is True and options["sanitize_overflow"] is False
    res = compile_prepass_for_sm90(tmp_path, text, {"debug": True, "sanitize_overflow": False})
    assert res["ok"] and res["asserts"], res
    assert res["pdl_launch_dependents"], res  # (PDL on: its dependent may launch at once)
    _, plain = prepass_source("t", specs, {"doc": "int32"}.__getitem__, {"doc": 1}.__getitem__)
    assert not plain.checks and "debug" not in SummaryPrepass(plain, {"B_i": 16}, None).options


def test_ids_no_summary_reads_get_a_guard_that_only_asserts(tmp_path, tmp_path_factory):
    """Ids that index a table but that no summary reads (``bias[doc[q]]`` in a score_mod:
    no mask, nothing to summarise) get a guard section: ``TILE`` entries a program, each
    asserted in [-n, n) on the device, nothing written.  Alone it is the whole pre-pass --
    the GPU's one check of those ids; beside summaries it is one more branch."""
    from neptune_eq.lowering.summary_kernel import TILE
    text, pre = prepass_source("t", [], {"doc": "int32"}.__getitem__, {"doc": 1}.__getitem__,
                               ids=[BIAS_IDS])
    assert pre.specs == () and pre.guards == (BIAS_IDS,) and pre.checks
    assert pre.kernel == "t_check_ids"
    assert text.count("tl.device_assert(") == 1 and "indexes bias (4 entries) outside [-4, 4)" in text
    assert pre.programs({"doc": (2 * TILE + 1,)}, {}) == [3]
    # run in the interpreter (which skips device asserts): one launch, no summaries
    fn, _, _ = _compile_text(text, pre, tmp_path_factory)
    drv = SummaryPrepass(pre, {}, fn)
    outs, launch, args, ints = drv.prepare({"doc": torch.arange(2 * TILE + 1, dtype=torch.int32) % 4})
    assert outs == {} and launch.grid[0] == 3
    launch.fn[launch.grid](*args, *ints, **launch.consts, **launch.options)
    assert drv.options["debug"] is True and drv.options["sanitize_overflow"] is False
    res = compile_prepass_for_sm90(tmp_path, text, {"debug": True, "sanitize_overflow": False})
    assert res["ok"] and res["asserts"] and res["pdl_launch_dependents"], res
    # beside a summary of another tensor: that tensor's summary, then the guard
    mixed, both = prepass_source("t", [SummarySpec("bs_pre_all", "pre", None, None)],
                                 {"doc": "int32", "pre": "int32"}.__getitem__,
                                 {"doc": 1, "pre": 1}.__getitem__, ids=[BIAS_IDS])
    assert both.tensors == (("pre", 1), ("doc", 1)) and "elif" not in mixed and "else:" in mixed
    assert both.programs({"doc": (10,), "pre": (3,)}, {}) == [1, 1]
    # a tensor a summary reads is asserted there, not twice
    _, once = prepass_source("t", doc_specs(), {"doc": "int32"}.__getitem__,
                             {"doc": 1}.__getitem__, ids=[BIAS_IDS])
    assert once.guards == ()
    with pytest.raises(ValueError, match="at least one summary"):
        prepass_source("t", [], {"doc": "int32"}.__getitem__, {"doc": 1}.__getitem__)


def _compile_text(text, pre, tmp_path_factory):
    src = "import triton\nimport triton.language as tl\n" + text
    if src not in _MODULES:
        enable_interpreter()
        path = tmp_path_factory.mktemp("prepass") / f"prepass_{len(_MODULES)}.py"
        path.write_text(src)
        name = f"neptune_eq_test_prepass_{len(_MODULES)}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[src] = mod
    return getattr(_MODULES[src], pre.kernel), pre, text


@pytest.fixture
def device_asserts(monkeypatch):
    """The interpreter with ``tl.device_assert`` on (it skips them by default), so a
    guard's assert can be seen to fire on CPU."""
    import dataclasses
    import triton.runtime.interpreter as interp
    b = interp.interpreter_builder
    monkeypatch.setattr(b, "options", dataclasses.replace(b.options, debug=True))


def _runtime_size(name: str, value: int):
    from neptune_eq.sizes import Guards, SymInt
    return SymInt.symbol(name, value, Guards())


# box (per dimension: all of it, or (start, count)), the ids' shape
BOXES = {"2-D whole": ((None, None), (3, 37)),            # bias[doc[b, q]]
         "shifted": (((1, 29),), (33,)),                 # bias[doc[q + 1]], q < 29
         "row of 2-D": (((2, 1), None), (4, 2 * 1024 + 5)),  # bias[doc[2, q]]: 3 programs
         "2-D block": (((1, 2), (5, 4)), (4, 11)),
         "runtime count": (((3, _runtime_size("L", 26)),), (33,)),  # doc[q + 3], q < n_L
         "0-d": ((), ())}                                  # bias[which[()], q]


@pytest.mark.parametrize("box, shape", BOXES.values(), ids=BOXES.keys())
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # (asserts stay on)
@given(data=st.data())
def test_a_guard_asserts_exactly_the_entries_of_its_box(box, shape, data, device_asserts,
                                                        tmp_path_factory):
    """A guard reads the box of entries the kernel reads (``data_indices.IdCheck``): an id
    past the table inside it stops the call, one outside it -- never read -- does not."""
    ids = IdCheck("doc", 4, "bias", box)
    text, pre = prepass_source("t", [], {"doc": "int32"}.__getitem__,
                               {"doc": len(shape)}.__getitem__, ids=[ids])
    fn, _, _ = _compile_text(text, pre, tmp_path_factory)
    drv = SummaryPrepass(pre, {}, fn, sizes={"L": 26})
    assert pre.sizes == (("L",) if "n_L" in text else ())
    base = torch.randint(-4, 4, (2 * shape[0], *shape[1:]) if shape else (), dtype=torch.int32)
    doc = base[::2] if shape else base  # strided: the guard must follow the tensor's strides
    at = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    inside = all(b is None or b[0] <= i < b[0] + int(b[1]) for i, b in zip(at, box))
    doc[at] = data.draw(st.sampled_from([4, -5, 1000]))

    def run():
        _, launch, args, ints = drv.prepare({"doc": doc})
        launch.fn[launch.grid](*args, *ints, **launch.consts, **launch.options)
    if inside:
        with pytest.raises(Exception, match="indexes bias"):
            run()
    else:
        run()
    doc[at] = 3
    run()  # every id in range: no assert


def test_a_boxed_guard_compiles_for_sm90(tmp_path):
    text, pre = prepass_source("t", [], {"doc": "int32"}.__getitem__, {"doc": 2}.__getitem__,
                               ids=[IdCheck("doc", 4, "bias", ((1, 2), None))])
    assert "guard: every entry of doc[1:3, :] indexes bias inside [-4, 4)" in text
    assert pre.programs({"doc": (5, 3000)}, {}) == [3]
    res = compile_prepass_for_sm90(tmp_path, text, {"debug": True, "sanitize_overflow": False})
    assert res["ok"] and res["asserts"] and res["pdl_launch_dependents"], res
