"""Tensor-descriptor (TMA) tiles and warp-specialised key loops: lowering choices per config.

The interpreter (Triton 3.9) runs descriptor loads and stores (zero-filling outside the
descriptor's shape, like TMA), so the TMA form of every kernel here is checked against
the fp64 reference like the pointer form; the warp-specialised form is the same code with
a loop attribute the interpreter ignores, so its GPU form is compiled for sm_90 on CPU
(``sm90_compile.py``) and checked for structure; the GPU run (bench/gpu_validate_tma.py)
validates its numbers."""
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import neptune_eq as ne
from helpers import random_inputs
from sm90_compile import compile_for_sm90
from neptune_eq.frontend import examples
from neptune_eq.interp import evaluate
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import TileConfig, candidate_configs

_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}


def _run(kern, config, ins):
    prog = kern.program
    outs = {n: torch.full(prog.shape_of(n), float("nan"), dtype=getattr(torch, prog.dtype_of(n)))
            for n in prog.outputs}
    la = Launcher(prog, kern.kernel_source, "interpreter", config)
    la({**ins, **outs})
    return la, outs[prog.outputs[0]]


def _check_both(out, scale=1.0, tma_expected=True, **cfg):
    """Pointer and TMA forms of the chosen kernel both equal the fp64 reference."""
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    prog = kern.input_program
    ins = random_inputs(prog, scale)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    bound = _TOL[prog.dtype_of(prog.outputs[0])] * max(1.0, ref.abs().max().item())
    got = {}
    for tma in (False, True):
        la, y = _run(kern, replace(kern.config, tma=tma, **cfg), ins)
        assert la.tma == (tma and tma_expected) and la._pointer_twin is None
        assert torch.isfinite(y).all()
        err = (y.double() - ref).abs().max().item()
        assert err <= bound, f"tma={tma}: max error {err:.3e} > {bound:.3e}"
        got[tma] = y
    return kern, got


@pytest.mark.parametrize("shape, dtype", [
    ((1, 2, 20, 37, 64, ), "float16"),    # odd rows and keys: zero-filled tails
    ((2, 1, 33, 50, 32), "bfloat16"),
    ((1, 1, 17, 23, 16), "float32"),
])
def test_attention_tma_tiles_match_reference(shape, dtype):
    kern, _ = _check_both(examples.attention(*shape, dtype))
    src = kern.source
    for t in ("q", "k", "v", "o"):  # Q in the prologue, K/V in the loop, the output store
        assert f"{t}_desc" in src
    assert ".load([l0, 0])" in src and ".store([pid_block * B_i, 0]" in src
    assert kern.kernel_source.descriptors == {"q": (2,), "k": (2,), "v": (2,), "o": (2,)}


def test_tma_large_magnitude_scores():
    _check_both(examples.attention(1, 2, 19, 45, 32, "float16"), scale=30.0)


def test_warp_specialized_form_runs_in_the_interpreter():
    """The WS constexpr form (its loop holds the ring at WS_RING whatever LOOP_STAGES asks:
    a deeper ring miscompiled on Triton 3.6) is valid source: same answer as the others."""
    kern, got = _check_both(examples.attention(1, 2, 20, 37, 64, "float16"))
    assert kern.kernel_source.warp_specializable == (4,)
    ins = random_inputs(kern.input_program)
    ref = evaluate(kern.input_program, ins)[kern.program.outputs[0]]
    la, y = _run(kern, replace(kern.config, tma=True, warp_specialize=True, loop_stages=3), ins)
    assert la.consts["WS"] and la.consts["LOOP_STAGES"] == 3
    assert (y.double() - ref).abs().max().item() <= 2e-3 * max(1.0, ref.abs().max().item())


def test_causal_gqa_tma_masked_rows_and_boundary_loops():
    """Causal with an offset (rows 0..5 see no key: fully masked rows give 0), GQA packed
    heads: K/V through descriptors, the packed Q rows stay pointer loads."""
    out = ne.attention(1, 4, 33, 70, 32, "float16", kv_heads=2,
                       mask_mod=lambda b, h, i, j: j <= i - 6)
    kern, got = _check_both(out)
    assert set(kern.kernel_source.descriptors) == {"k", "v"}
    assert kern.kernel_source.warp_specializable == ()  # a pointer load remains
    assert (got[True][:, :, :6] == 0).all()


def test_causal_is_not_warp_specialized():
    """Causal: 4 warps failed to compile on Triton 3.6 and 8 left the loop unspecialised
    (bench/results/ws_probe/README.md), so no warp-specialised configs are offered."""
    kern, _ = _check_both(ne.attention(1, 2, 40, 40, 32, "float16",
                                       mask_mod=lambda b, h, i, j: j <= i))
    src = kern.source
    assert kern.kernel_source.warp_specializable == ()
    # the interior loop is the one that may be specialised; boundary loops stay plain
    assert src.count("warp_specialize=WS") == 1 and "# interior: no mask" in src
    head = src.split("warp_specialize=WS")[0].rsplit("\n", 1)[1]
    assert "tl.range(" in head


def test_softmax_two_passes_and_epilogue_column_loop():
    """x[i, j] with j the last dim: the loop block is the descriptor's column block."""
    kern, _ = _check_both(examples.softmax(5, 40), loop_stages=3)  # 160-byte rows: aligned
    assert kern.source.count("x_desc") >= 2 and "c0" in kern.source


def test_split_k_decode_tma():
    """The split-k candidate (partial + combine, and one launch) with TMA tiles."""
    out = ne.attention(1, 4, 1, 300, 32, "float16", kv_heads=4,
                       mask_mod=lambda b, h, i, j: j <= i + 299)
    kern = ne.superoptimize(out, target="interpreter", cache=False)
    row = next(r for r in kern.candidates if r.kernel is not None and r.kernel.split_extent)
    prog = kern.input_program
    ins = random_inputs(prog)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    assert {"k", "v"} <= set(row.kernel.descriptors)
    for fused in (False, True):
        cfg = TileConfig({"B_i": 16, "B_L": 16}, 4, 1, 3, fused=fused, tma=True)
        outs = {"o": torch.full((1, 4, 1, 32), float("nan"), dtype=torch.float16)}
        la = Launcher(row.program, row.kernel, "interpreter", cfg)
        la({**ins, **outs})
        assert la.tma and la._pointer_twin is None
        err = (outs["o"].double() - ref).abs().max().item()
        assert err <= 2e-3 * max(1, ref.abs().max().item()), (fused, err)


def test_unaligned_tensors_fall_back_to_pointer_loads():
    """A view whose row stride is not a 16-byte multiple (and one with a strided last dim)
    runs the pointer form: right answer, no crash."""
    kern = ne.superoptimize(examples.attention(1, 1, 16, 24, 16, "float16"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    ins = random_inputs(prog)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    k = ins["k"]
    odd = torch.zeros(1, 1, 24, 20, dtype=k.dtype)[..., :16]  # row stride 20 * 2 = 40 bytes
    odd.copy_(k)
    strided = torch.zeros(1, 1, 24, 32, dtype=k.dtype)[..., ::2]  # last stride 2
    strided.copy_(k)
    for view in (odd, strided):
        la, y = _run(kern, replace(kern.config, tma=True), {**ins, "k": view})
        assert la._pointer_twin is not None and not la._pointer_twin.tma
        assert (y.double() - ref).abs().max().item() <= 2e-3 * max(1, ref.abs().max().item())


def test_rows_under_16_bytes_run_the_pointer_form():
    """Head dim 4 in fp16: 8-byte rows, no TMA stride -- the TMA config runs pointer loads,
    and the GPU timer records the TMA configs as skipped instead of timing them."""
    from neptune_eq.runtime.tuning import time_configs
    kern = ne.superoptimize(examples.attention(1, 1, 5, 9, 4, "float16"), target="interpreter",
                            cache=False)
    prog = kern.input_program
    ins = random_inputs(prog)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    la, y = _run(kern, replace(kern.config, tma=True), ins)
    assert la._pointer_twin is not None
    assert (y.double() - ref).abs().max().item() <= 2e-3 * max(1, ref.abs().max().item())
    outs = {"o": torch.empty(prog.shape_of("o"), dtype=torch.float16)}
    res = time_configs(kern.program, kern.kernel_source, "cuda", {**ins, **outs},
                       [replace(kern.config, tma=True)])
    assert res[0][1] is None and res[0][2].startswith("skipped: tensor descriptors need")


def test_gpu_configs_include_variants_and_the_cost_model_prunes_them(monkeypatch):
    from neptune_eq.choosing.choose import TMA_KEEP, WS_KEEP, prune_configs
    from neptune_eq.lowering.descriptors import WS_MIN_KEYS, WS_MIN_ROWS, WS_RING, WS_WARPS
    monkeypatch.delenv("NEPTUNE_EQ_WARP_SPECIALIZE", raising=False)  # off by default
    assert not any(c.warp_specialize for c in candidate_configs(ne.superoptimize(
        examples.attention(1, 32, 4096, 4096, 128, "float16"), target="interpreter",
        cache=False).kernel_source, "cuda"))
    monkeypatch.setenv("NEPTUNE_EQ_WARP_SPECIALIZE", "1")  # the opt-in
    from neptune_eq.choosing.costmodel import DEVICES
    kern = ne.superoptimize(examples.attention(1, 32, 4096, 4096, 128, "float16"),
                            target="interpreter", cache=False)
    ks = kern.kernel_source
    allc = candidate_configs(ks, "cuda")
    assert any(c.tma and not c.warp_specialize for c in allc)
    ws = [c for c in allc if c.warp_specialize]
    # only the form that was right on Triton 3.6 (descriptors: WS_*), one per tile shape
    assert ws and len({str(c) for c in ws}) == len(ws)
    assert all(c.tma and c.num_warps == WS_WARPS and c.num_stages == WS_RING and not c.loop_stages
               and c.blocks["B_i"] >= WS_MIN_ROWS and c.blocks["B_L"] >= WS_MIN_KEYS for c in ws)
    assert f"num_stages={WS_RING} if WS else LOOP_STAGES, warp_specialize=WS" in ks.source
    kept = prune_configs(kern.plan, allc, DEVICES["H200"])
    pointer = [c for c in allc if not c.tma]
    # the pointer baseline, in its order, but shapes predicted to spill heavily: only
    # shapes that do spill at D = 128 (bench/results/static_sm90.md) may be dropped
    kept_pointer = [c for c in kept if not c.tma]
    assert kept_pointer == [c for c in pointer if c in kept_pointer] and len(kept_pointer) >= 3
    dropped = {str(c) for c in pointer if c not in kept_pointer}
    assert dropped and dropped <= {"B_i=128 B_L=32 warps=4 stages=3", "B_i=64 B_L=128 warps=4 stages=2",
                                   "B_i=128 B_L=128 warps=8 stages=2", "B_i=32 B_L=128 warps=4 stages=3"}
    assert sum(c.tma and not c.warp_specialize for c in kept) == TMA_KEEP
    assert sum(c.warp_specialize for c in kept) == WS_KEEP
    with pytest.raises(ValueError, match="needs tma"):
        Launcher(kern.program, ks, "interpreter", replace(allc[0], warp_specialize=True))


def _compile_sm90(kern, **flags):
    ks = kern.kernel_source
    consts = {**ks.tunables, "B_i": 128, "B_L": 64}
    consts.update({f: False for f in ks.even_flags})
    consts.update(TMA=flags.get("tma", False), WS=flags.get("ws", False), LOOP_STAGES=3,
                  VDOT=False)
    if ks.summaries:  # launched dependent on the summaries' pre-pass, or not
        consts["PDL"] = flags.get("pdl", False)
    of = {sp.name: sp.tensor for sp in ks.summaries}  # a block summary: its tensor's dtype
    dtypes = {f"{n}_ptr": {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32",
                           "int32": "*i32"}[kern.program.dtype_of(of.get(n, n))]
              for n in [p[:-4] for p in ks.params]}
    path = Path(os.environ["NEPTUNE_EQ_CACHE"]) / f"sm90_{abs(hash(ks.source))}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ks.source)
    spec = {"dtypes": dtypes, "constexprs": consts, "num_warps": flags.get("warps", 4),
            "num_stages": 3, "options": {"launch_pdl": True} if flags.get("pdl") else {}}
    return compile_for_sm90(path, ks.name, spec, timeout=300, python=flags.get("python"))


def test_gpu_form_compiles_for_sm90_with_tma_and_warp_specialization():
    """The GPU source of the TMA and TMA + warp-specialised variants compiles for sm_90
    (newest Triton's compiler here; 3.6 on the GPU machine): the PTX uses the bulk tensor
    copy engine and wgmma, and 4-warp specialisation splits registers (setmaxnreg)."""
    kern = ne.superoptimize(examples.attention(1, 4, 1000, 1000, 128, "float16"),
                            target="interpreter", cache=False)
    plain = _compile_sm90(kern)
    assert plain["ok"] and plain["wgmma"] and not plain["tma"]
    tma = _compile_sm90(kern, tma=True)
    assert tma["ok"] and tma["tma"] and tma["wgmma"]
    ws = _compile_sm90(kern, tma=True, ws=True, warps=4)
    assert ws["ok"] and ws["tma"] and ws["setmaxnreg"], ws


def test_data_mask_key_ranges_compile_for_sm90():
    """Sorted document ids: the key ranges counted from the block summaries (vector loads
    and sums before the key loop, ``block_skip._count_failing``) and the three range loops
    compile for sm_90 in both load forms."""
    doc = ne.placeholder((256,), "int32", "doc")
    kern = ne.superoptimize(ne.attention(1, 2, 256, 256, 64, "float16",
                                         mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)),
                            target="interpreter", cache=False)
    assert "bs_n" in kern.kernel_source.source and "if mono0_" in kern.kernel_source.source
    for flags in ({}, {"tma": True}, {"tma": True, "pdl": True}):
        res = _compile_sm90(kern, **flags)
        assert res["ok"] and res["wgmma"], res
        # launched dependent on the pre-pass (Hopper): it waits for it, and only then
        assert res["pdl_wait"] == res["launch_pdl"] == bool(flags.get("pdl")), res


def test_a_config_that_fails_to_compile_is_recorded_and_skipped(monkeypatch):
    """A warp-specialised config whose compile raises (as causal + 4 warps did on Triton
    3.6) is recorded with its reason by the timer, not compiled twice, never fatal."""
    from neptune_eq.runtime import launcher as lr, tuning
    kern = ne.superoptimize(examples.attention(1, 1, 16, 32, 16, "float16"), target="interpreter",
                            cache=False)
    ks, prog = kern.kernel_source, kern.program
    ws = replace(kern.config, tma=True, warp_specialize=True, num_warps=4)
    calls = []

    def compile_(self, tensors):
        calls.append(str(self.config))
        if self.config.warp_specialize:
            raise RuntimeError("PassManager::run failed\nunsupported load type for producer commit")
    monkeypatch.setattr(lr.Launcher, "compile", compile_)
    monkeypatch.setattr(tuning, "compile_threads", lambda: 2)
    ins = {n: torch.randn(prog.shape_of(n)).half() for n in ("q", "k", "v", "o")}
    tuning.compile_in_parallel([(prog, ks, kern.config), (prog, ks, ws)], "cuda", ins)
    assert len(calls) == 2
    res = tuning.time_configs(prog, ks, "cuda", ins, [ws])
    assert res == [(ws, None, "failed: unsupported load type for producer commit")]


def test_a_walk_twin_is_compiled_once(monkeypatch):
    """A persistent Gluon form launched one program per tile is the same kernel as its
    persistent twin: the cold build's thread pool compiles it once (two threads compiling
    one kernel at once both compiled it), and times both."""
    from neptune_eq.runtime import launcher as lr, tuning
    kern = ne.superoptimize(examples.attention(1, 1, 16, 32, 16, "float16"), target="interpreter",
                            cache=False)
    ks, prog = kern.kernel_source, kern.program
    other = replace(kern.config, num_stages=kern.config.num_stages + 1)
    calls = []
    monkeypatch.setattr(lr.Launcher, "compile", lambda self, tensors: calls.append(self.config))
    monkeypatch.setattr(tuning, "compile_threads", lambda: 2)
    ins = {n: torch.randn(prog.shape_of(n)).half() for n in ("q", "k", "v", "o")}
    jobs = [(prog, ks, kern.config), (prog, ks, replace(kern.config, per_tile=True)),
            (prog, ks, replace(other, per_tile=True))]   # (the last has no twin here)
    tuning.compile_in_parallel(jobs, "cuda", ins)
    assert sorted(map(str, calls)) == sorted([str(kern.config), str(replace(other, per_tile=True))])
