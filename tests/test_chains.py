"""Reduction chains beyond attention (issue 15): each one written plainly superoptimizes,
equals a torch fp64 reference on odd sizes and large-magnitude inputs, and runs as one
kernel launch in the passes its fused form needs (after a check of the ids, where it
gathers at ids read from data)."""
import pytest
import torch

import neptune_eq as ne
from neptune_eq.frontend.chains import CHAINS, random_inputs
from neptune_eq.lowering.inline import inline_derived, isolate_reductions
from neptune_eq.ir import fmt
from neptune_eq.lowering.data_indices import checked_ids

# Odd sizes, none a multiple of a block; the second has a single row.
SHAPES = [dict(N=5, M=37, E=7, K=11, V=29, R=13), dict(N=1, M=50, E=5, K=19, V=41, R=6)]
GATHERED_AT_IDS = {"cross-entropy", "gathered-values", "linear-cross-entropy"}  # x[i, target[i]]


def _check(chain, kern, sizes, seed, scale):
    prog = kern.input_program
    ins = random_inputs(chain, prog, sizes, seed, scale)
    got = kern(**{k: v.float() if v.is_floating_point() else v for k, v in ins.items()})
    got = got if isinstance(got, tuple) else (got,)
    ref = chain.reference(ins)
    assert len(got) == len(prog.outputs) == len(ref)
    for name, g in zip(prog.outputs, got):
        r = ref[name]
        assert g.shape == r.shape, name
        assert torch.isfinite(g).all(), f"{chain.name}: {name} has non-finite values"
        err = (g.double() - r).abs().max().item()
        bound = 2e-4 * max(1.0, r.abs().max().item())
        assert err <= bound, f"{chain.name}: {name} max error {err:.3e} > {bound:.3e} (scale {scale})"


def launches(kern) -> list[str]:
    """One launch, whatever the passes, named after the chain's output -- after a check of
    the ids where the chain gathers at them (``x[i, target[i]]``): the GPU asserts them in
    range before the chain reads off a clamp (``summary_kernel``'s guard)."""
    main = "neptune_" + "_".join(kern.program.outputs)
    return ([f"{main}_check_ids"] if checked_ids(kern.program) else []) + [main]


@pytest.mark.parametrize("sizes", SHAPES, ids=["5-rows", "1-row"])
@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_superoptimizes_and_equals_torch(name, sizes):
    chain = CHAINS[name]
    kern = ne.superoptimize(chain.build(sizes), target="interpreter", cache=False)
    assert kern.launches == launches(kern)
    assert bool(checked_ids(kern.program)) == (name in GATHERED_AT_IDS)
    assert kern.plan.n_passes == chain.passes, kern.plan.describe()
    for seed, scale in [(0, 1.0), (1, 1.0), (2, 300.0)]:   # large magnitudes: no raw exp
        _check(chain, kern, sizes, seed, scale)


def test_at_least_twelve_chains_cover_both_failure_classes_and_gathers():
    assert len(CHAINS) >= 12
    # cause 1 (an elementwise definition between reductions) occurs in these programs
    nested = [n for n, c in CHAINS.items() if isolate_reductions(c.program(SHAPES[0]))
              is not c.program(SHAPES[0])]
    assert len(nested) >= 6
    progs = {n: c.program(SHAPES[0]) for n, c in CHAINS.items()}
    gathers = [n for n, p in progs.items() if any(
        a.op == "load" for d in p.defs for t in d.body.walk() if t.op == "load" for a in t.args)]
    assert {"cross-entropy", "gathered-values", "linear-cross-entropy"} <= set(gathers)


def test_isolate_reductions_splits_a_derived_statistic():
    prog = CHAINS["variance"].program(SHAPES[0])
    out = isolate_reductions(prog)
    bodies = {d.name: fmt(d.body) for d in out.defs}
    assert out.definition("mean_sum").body.op == "sum" and out.definition("mean_sum").axes == ("i",)
    assert bodies["mean"] == "(mean_sum[i] / 37)"
    assert [d.name for d in out.defs] == ["mean_sum", "mean", "var"]
    # an output nobody reads keeps its nested reduction (the epilogue computes it)
    assert fmt(out.definition("var").body).startswith("(sum[k")
    # nothing to do: the same object back
    plain = CHAINS["cross-entropy"].program(SHAPES[0])
    assert isolate_reductions(plain) is plain


def test_independent_folds_over_different_extents_get_loops_of_their_own():
    kern = ne.superoptimize(CHAINS["linear-cross-entropy"].build(SHAPES[0]), target="interpreter",
                            cache=False)
    extents = [p.extent for p in kern.plan.passes]
    assert sorted(extents) == [11, 29]                  # the target logit over K, the LSE over V
    assert kern.source.count("tl.dot(") >= 1            # logits tile x·W inside the V loop


def test_a_candidate_that_cannot_be_lowered_falls_back_to_the_next(monkeypatch):
    """The fused (rolling) candidates are made unlowerable: the plain multi-pass form is
    chosen, still correct, and the table records why each fused one was skipped."""
    from neptune_eq.choosing import choose
    from neptune_eq.lowering.lower import LoweringError, plan as real_plan

    def picky(program, *a, **k):
        if any(t.kind == "fold" for d in program.defs for t in d.body.walk()):
            raise LoweringError("test: fused folds refused")
        return real_plan(program, *a, **k)
    monkeypatch.setattr(choose, "make_plan", picky)
    chain = CHAINS["softmax-plus-c"]
    kern = ne.superoptimize(chain.build(SHAPES[0]), target="interpreter", cache=False)
    assert not any(t.kind == "fold" for d in kern.program.defs for t in d.body.walk())
    assert kern.plan.n_passes == 3                      # max, then sum, then the output
    assert "not lowered: test: fused folds refused" in kern.candidate_table()
    _check(chain, kern, SHAPES[0], 0, 1.0)


@pytest.mark.parametrize("name", ["linear-lse", "linear-cross-entropy"])
def test_contraction_wider_than_registers_loops_inside_the_vocabulary_loop(name):
    """K = 300 > 256 cannot be held whole: the logits tile x·W is folded over chunks of K
    in a loop nested in the V loop (a tile dot per chunk), never written to memory."""
    sizes = dict(N=3, K=300, V=29)
    chain = CHAINS[name]
    kern = ne.superoptimize(chain.build(sizes), target="interpreter", cache=False)
    assert kern.launches == launches(kern) and kern.plan.chunked
    src = kern.source
    v_loop = src.index("for l0 in tl.range(0, j_wh0, B_L")  # the V loop's whole blocks
    k_loop = src.index("for c", v_loop)
    assert src.index("tl.dot(", k_loop) > k_loop           # the dot sits in the K loop
    assert src.count("tl.store(") == 1                    # only the result leaves the kernel
    assert "inner contraction over kk" in kern.explain()   # the plan says so
    for seed, scale in [(0, 1.0), (1, 30.0)]:
        _check(chain, kern, sizes, seed, scale)


@pytest.mark.parametrize("name", ["layernorm", "sinkhorn-row", "softmax-and-lse"])
def test_lowering_recomputes_derived_definitions_where_they_are_read(name):
    """A program handed straight to the lowering (no isolation before saturation, as a
    rewrite may produce it): a definition read by others that is arithmetic over
    reductions is split into folds and recomputed per row from their final states."""
    from neptune_eq.lowering.kernelgen import generate
    from neptune_eq.lowering.lower import plan
    from neptune_eq.runtime.launcher import Launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    chain, sizes = CHAINS[name], SHAPES[0]
    prog = chain.program(sizes)
    assert inline_derived(prog) is not prog
    tp = plan(prog)
    src = generate(tp)
    ins = random_inputs(chain, prog, sizes, 0)
    bound = {k: v.float() if v.is_floating_point() else v for k, v in ins.items()}
    for out in prog.outputs:
        bound[out] = torch.empty(prog.shape_of(out))
    Launcher(prog, src, "interpreter", candidate_configs(src, "interpreter")[0])(bound)
    ref = chain.reference(ins)
    for out in prog.outputs:
        assert (bound[out].double() - ref[out]).abs().max().item() <= 2e-4 * max(1.0, ref[out].abs().max().item())


def test_a_crash_while_lowering_one_candidate_is_recorded_not_raised(monkeypatch):
    """Not only LoweringError: any failure lowering a candidate is recorded in the table
    and the next candidate is used."""
    from neptune_eq.choosing import choose
    real = choose.generate

    def flaky(plan, **kw):
        if any(f.op in ("rollsum", "rollmax") for p in plan.passes for f in p.folds):
            raise KeyError("simulated codegen bug")
        return real(plan, **kw)
    monkeypatch.setattr(choose, "generate", flaky)
    chain = CHAINS["softmax-one"]
    kern = ne.superoptimize(chain.build(SHAPES[0]), target="interpreter", cache=False)
    assert "lowering failed (KeyError" in kern.candidate_table()
    _check(chain, kern, SHAPES[0], 0, 1.0)


def _run_config(kern, program, ks, config, ins: dict) -> dict:
    """The chain's inputs and outputs by name after one interpreter run of kernel ``ks``
    (of ``program``, a candidate of ``kern``) at tile config ``config``."""
    from neptune_eq.runtime.gluon_launch import make_launcher
    bound, _ = kern._bind_static(tuple(ins[ph.name] for ph in kern.input_program.inputs), {})
    make_launcher(program, ks, "interpreter", config)(bound)
    return bound


@pytest.mark.parametrize("name", ["variance", "log-softmax"])
def test_row_wise_chains_offer_few_rows_a_program_and_each_is_right(name):
    """A chain without a contraction whose rows would fill few programs at 32+ rows a
    program is offered a few rows a program too (``tile_configs.ROW_WISE_SHAPES``): each
    such config, split-k ones included, equals the reference in the interpreter; a chain
    with a contraction (a tensor-core tile of >= 16 rows) is not offered them."""
    from dataclasses import replace

    from neptune_eq.runtime.tile_configs import (ROW_WISE_SHAPES, WHOLE_ROW_SHAPES,
                                                 candidate_configs)
    sizes = dict(N=37, M=300, E=7, K=11, V=29, R=13)
    chain = CHAINS[name]
    kern = ne.superoptimize(chain.build(sizes), target="interpreter", cache=False)
    ks, prog = kern.kernel_source, kern.input_program
    rows = {bi for bi, *_ in ROW_WISE_SHAPES + WHOLE_ROW_SHAPES}
    cfgs = [c for c in candidate_configs(ks, "cuda") if c.blocks[f"B_{ks.block_axis}"] in rows]
    assert {c.blocks[f"B_{ks.block_axis}"] for c in cfgs} == rows
    # the whole row (300 columns) in one step of 512, where the kernel does not split
    whole = {(c.blocks[f"B_{ks.block_axis}"], c.num_warps, c.num_stages) for c in cfgs
             if c.blocks["B_L"] == 512 and c.num_stages == 1}
    assert whole == (set() if ks.split_extent else set(WHOLE_ROW_SHAPES))
    ins = {k: (v.float() if v.is_floating_point() else v)
           for k, v in random_inputs(chain, prog, sizes, 0, 30.0).items()}
    ref = chain.reference(ins)
    for c in {str(c): c for c in cfgs}.values():
        got = _run_config(kern, kern.program, ks, replace(c, num_stages=1), ins)
        for o in prog.outputs:
            err = (got[o].double() - ref[o]).abs().max().item()
            assert err <= 2e-4 * max(1.0, ref[o].abs().max().item()), (c, o, err)
    dot = ne.superoptimize(CHAINS["linear-lse"].build(dict(N=37, K=11, V=29)),
                           target="interpreter", cache=False).kernel_source
    assert not any(c.blocks[f"B_{dot.block_axis}"] in rows for c in candidate_configs(dot, "cuda"))


def _check_both_split_forms(kern, row, chain, sizes):
    """Candidate ``row``'s split-k kernel at its first interpreter config, in two launches
    and in one, equals the chain's reference at scales 1 and 30; returns that config."""
    from dataclasses import replace

    from neptune_eq.runtime.tile_configs import candidate_configs
    cfg = candidate_configs(row.kernel, "interpreter")[0]
    assert cfg.splits >= 2
    prog = kern.input_program
    for seed, scale in [(0, 1.0), (1, 30.0)]:
        ins = {k: (v.float() if v.is_floating_point() else v)
               for k, v in random_inputs(chain, prog, sizes, seed, scale).items()}
        ref = chain.reference(ins)
        for fused in (False, True):
            got = _run_config(kern, row.program, row.kernel, replace(cfg, fused=fused), ins)
            for o in prog.outputs:
                err = (got[o].double() - ref[o]).abs().max().item()
                assert err <= 2e-4 * max(1.0, ref[o].abs().max().item()), (fused, scale, o, err)
    return cfg


@pytest.mark.parametrize("sizes", [dict(N=37, K=11, V=300), dict(N=5, K=300, V=77)],
                         ids=["37-rows", "5-rows-chunked-k"])
def test_split_vocabulary_runs_the_gathered_dot_in_the_combine(sizes):
    """Linear + cross-entropy: the vocabulary's log-sum-exp is a split-k pass, and the
    target's logit ``Σ_k x[i, k] w[k, t[i]]`` a pass of its own over k.  Split-k cuts the
    first pass into chunks; the later one runs whole in the combine (two launches, or
    the one-launch form's last program), so a few hundred rows still fill the GPU
    (N=512 ran 8-32 programs unsplit: 19x torch eager's time, H200, session 41).  Both
    forms equal the reference, on large-magnitude inputs too."""
    from dataclasses import replace

    chain = CHAINS["linear-cross-entropy"]
    kern = ne.superoptimize(chain.build(sizes), target="interpreter", cache=False)
    (row,) = [r for r in kern.candidates if r.plan is not None and r.plan.split]
    assert row.structure.startswith("2 pass(es) [max+splitk | sum], split-k")
    cfg = _check_both_split_forms(kern, row, chain, sizes)
    # the two-launch combine runs the later pass a row a program (it has no tl.dot); the
    # one-launch form's last program of a row block combines that block's rows
    from neptune_eq.runtime.gluon_launch import make_launcher
    assert row.kernel.combine_min_rows == 1
    n, bi = sizes["N"], cfg.blocks[f"B_{row.kernel.block_axis}"]
    for fused, grid, rows in [(False, n, 1), (True, -(-n // bi), min(bi, 1 << (n - 1).bit_length()))]:
        launch = make_launcher(row.program, row.kernel, "interpreter",
                               replace(cfg, fused=fused))._launches[-1]
        assert (launch.grid[0], launch.consts["B_IC"]) == (grid, rows), fused
    # a combine that only folds partials keeps its row blocks; one that writes a row's
    # columns after them (log-softmax's y = x - lse) spreads its rows too
    for name, least in [("linear-lse", 0), ("log-softmax", 1)]:
        other = ne.superoptimize(CHAINS[name].build(dict(N=37, M=300, K=11, V=300)),
                                 target="interpreter", cache=False)
        split = [r.kernel for r in other.candidates if r.plan is not None and r.plan.split]
        assert split and {ks.combine_min_rows for ks in split} == {least}, name


def test_a_sum_without_the_row_axis_splits_beside_per_row_sums():
    """Centered matmul, ``Σ_k (x[i, k] - mean[i]) w[k, e] = Σ_k x·w - mean[i]·Σ_k w[k, e]``:
    the last sum has no row axis, so every row block computes the same partial.  Split-k
    stores one copy per row block (a one-launch combine may read only its own block's
    chunks) and folds it like the per-row ones: both forms equal the reference, on
    large-magnitude inputs too (4096 rows of 64 columns ran 64 programs unsplit)."""
    sizes = dict(N=37, M=300, E=20)
    chain = CHAINS["centered-matmul"]
    kern = ne.superoptimize(chain.build(sizes), target="interpreter", cache=False)
    split = [r for r in kern.candidates if r.plan is not None and r.plan.split]
    assert split, [r.status for r in kern.candidates]
    row = split[0]
    rowless = [f.name for f in row.plan.passes[0].folds if "i" not in f.state_axes]
    assert rowless == ["y_f1"]
    text = row.kernel.source
    assert "tl.store(ws_y_f1_ptr + ((pid_split * 1 + pid_grid) * 37 + pid_block) * 32" in text
    assert "ws_y_f1_ptr + ((offs_P[:, None] * 1 + pid_grid) * 37 + 0) * 32" in text
    assert "ws_y_f1_ptr + ((offs_P_c[:, None] * 1 + pid_grid_c) * 37 + pid_block_c) * 32" in text
    _check_both_split_forms(kern, row, chain, sizes)


def test_fp32_contractions_follow_torchs_float32_matmul_precision(monkeypatch):
    """x·W of two float32 inputs: exact fp32 products under "highest", TF32 under "high"
    -- torch's current setting unless given -- a distinct cache entry each (a TF32 kernel
    never serves an exact-fp32 caller), and an unknown setting is refused by name.  The
    interpreter computes both in fp32, so the result is checked here; the GPU's TF32 error
    is held to fp16's tolerance by translation validation (``output_tolerance``)."""
    from neptune_eq.choosing.translation_validation import output_tolerance
    sizes = dict(N=3, K=24, V=29)
    chain = CHAINS["linear-lse"]
    prog = chain.build(sizes)
    dots = {}
    for setting in ("highest", "high"):
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda s=setting: s)
        kern = ne.superoptimize(prog, target="interpreter", cache=False)
        dots[setting] = {ln.split("input_precision=")[1] for ln in kern.source.splitlines()
                         if "input_precision=" in ln}
        _check(chain, kern, sizes, 0, 1.0)
    assert dots == {"highest": {'"ieee")'}, "high": {'"tf32")'}}
    assert "tf32" in ne.superoptimize(prog, target="interpreter", cache=False,
                                      float32_matmul_precision="medium").source
    with pytest.raises(ValueError, match="float32_matmul_precision to be one of"):
        ne.superoptimize(prog, target="interpreter", float32_matmul_precision="tf32")
    program = kern.input_program
    (out,) = program.outputs
    assert output_tolerance(program, out) < output_tolerance(program, out, "tf32") == 1e-2


def test_a_tf32_kernel_is_validated_on_inputs_tf32_holds_exactly():
    """Rounding q and k to TF32 at scale 40 moves a score by units (a property of the
    format the caller chose): the kernel check draws float32 inputs on TF32's grid, where
    only computed operands round.  Ints and non-fp32 inputs are left as drawn."""
    from neptune_eq.choosing.translation_validation import consistent_inputs, tf32_rounded
    x = torch.randn(4096, dtype=torch.float64) * 40
    r = tf32_rounded(x)
    assert ((r - x).abs() <= x.abs() * 2.0 ** -11).all() and not torch.equal(r, x)
    assert torch.equal(tf32_rounded(r), r)                           # on the grid: exact
    assert (r.float().view(torch.int32) & 0x1FFF).eq(0).all()       # 13 low bits clear
    from neptune_eq.frontend.dsl import build_program
    prog = build_program(CHAINS["linear-cross-entropy"].build(dict(N=3, K=24, V=29)))
    plain = consistent_inputs(prog, {}, 0, 40.0, 2)
    on_grid = consistent_inputs(prog, {}, 0, 40.0, 2, tf32=True)
    for ph in prog.inputs:
        a, b = plain[ph.name], on_grid[ph.name]
        assert torch.equal(b, tf32_rounded(a) if ph.dtype == "float32" else a), ph.name


def test_the_fp32_precision_is_part_of_the_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("NEPTUNE_EQ_CACHE", str(tmp_path))
    prog = CHAINS["linear-lse"].build(dict(N=3, K=24, V=29))
    first = ne.superoptimize(prog, target="interpreter", float32_matmul_precision="highest")
    other = ne.superoptimize(prog, target="interpreter", float32_matmul_precision="high")
    again = ne.superoptimize(prog, target="interpreter", float32_matmul_precision="highest")
    assert (first.cache_status, other.cache_status, again.cache_status) == ("miss", "miss", "hit")
    assert '"tf32"' in other.source and '"tf32"' not in again.source
