"""The CUDA-core contraction form of one- and two-row kernels (``codegen.VDOT``): a
decode's QKᵀ and P·V as broadcast products summed on the CUDA cores, in programs of
exactly the query's rows, behind a constexpr beside the tensor-core ``tl.dot``.  Each
form of each launch shape (one pass, split-k in two launches, split-k in one) equals the
fp64 reference, including a fully masked row and large-magnitude scores."""
import pytest
import torch

import neptune_eq as ne
from helpers import random_inputs
from sm90_compile import compile_for_sm90
from neptune_eq.interp import evaluate
from neptune_eq.runtime.launcher import Launcher
from neptune_eq.runtime.tile_configs import TileConfig, candidate_configs, vector_dot_configs

_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _decode(hq, hkv, skv, dtype, d=16, visible=None):
    """One query at the end of ``skv`` keys (causal), an ALiBi-like score mod; with
    ``visible`` the query sees only keys below it (0: none -- a fully masked row)."""
    lim = skv - 1 if visible is None else visible - 1
    return ne.attention(1, hq, 1, skv, d, dtype, kv_heads=hkv,
                        mask_mod=lambda b, h, q, k: k <= q + lim,
                        score_mod=lambda s, b, h, q, k: s + 0.01 * (k - q))


def _run(row_kernel, program, cfg, ins):
    outs = {n: torch.full(program.shape_of(n), float("nan"), dtype=getattr(torch, program.dtype_of(n)))
            for n in program.outputs}
    Launcher(program, row_kernel, "interpreter", cfg)({**ins, **outs})
    return outs[program.outputs[0]]


def _rows(kern):
    """(plan, kernel source) of every lowered candidate: the split-k and one-pass ones."""
    return [(r.program, r.kernel) for r in kern.candidates if r.kernel is not None]


@pytest.mark.parametrize("hq, hkv, skv, dtype, scale", [
    (3, 3, 70, "float16", 1.0),     # one row per program, odd key count
    (4, 2, 45, "bfloat16", 1.0),    # two heads of a group packed: two rows
    (2, 2, 33, "float32", 30.0),    # large-magnitude scores (|s| in the hundreds)
])
def test_cuda_core_form_equals_the_reference(hq, hkv, skv, dtype, scale):
    kern = ne.superoptimize(_decode(hq, hkv, skv, dtype), target="interpreter", cache=False)
    ins = random_inputs(kern.input_program, scale)
    ref = evaluate(kern.input_program, ins)["o"]
    bound = _TOL[dtype] * max(1.0, ref.abs().max().item())
    rows = hq // hkv
    seen = set()
    for program, ks in _rows(kern):
        assert ks.vector_dot and "if VDOT else tl.dot(" in ks.source
        for split, fused in ((0, False), (3, False), (3, True)) if ks.split_extent else ((0, False),):
            cfg = TileConfig({f"B_{ks.block_axis}": rows, "B_L": 16}, 4, 1, split, fused=fused,
                             vector_dot=True)
            got = _run(ks, program, cfg, ins)
            err = (got.double() - ref).abs().max().item()
            assert torch.isfinite(got).all() and err <= bound, (str(cfg), err, bound)
            seen.add((bool(ks.split_extent), fused))
    assert (True, True) in seen and (True, False) in seen  # both split-k launch shapes ran


def test_cuda_core_form_of_a_fully_masked_row_is_zero():
    kern = ne.superoptimize(_decode(2, 2, 40, "float16", visible=-5), target="interpreter",
                            cache=False)
    ins = random_inputs(kern.input_program)
    for program, ks in _rows(kern):
        for split, fused in ((0, False), (3, False), (3, True)) if ks.split_extent else ((0, False),):
            cfg = TileConfig({"B_i": 1, "B_L": 16}, 4, 1, split, fused=fused, vector_dot=True)
            assert torch.equal(_run(ks, program, cfg, ins), torch.zeros(1, 2, 1, 16,
                                                                                dtype=torch.float16))


def test_cuda_core_form_is_offered_only_where_the_rows_are_few():
    """One or two rows and at most VDOT_MAX_KEYS keys: offered (programs of exactly those
    rows, 32 keys a step, splits for 2-8 programs an SM, combined in the same launch); a
    GQA group of 8 packed rows
    keeps tl.dot alone -- its [8, keys, width] product would spill -- and a config asking
    for it is an error."""
    def ks_of(hq, hkv, skv=8192, d=128):
        kern = ne.superoptimize(_decode(hq, hkv, skv, "float16", d=d), target="interpreter",
                                cache=False)
        return kern, kern.kernel_source
    _, one = ks_of(32, 32, skv=1024)
    cfgs = vector_dot_configs(one)
    assert cfgs and all(c.vector_dot and c.blocks["B_i"] == 1 for c in cfgs)
    assert all(c.fused and c.blocks["B_L"] == 32 for c in cfgs)
    assert [c.splits for c in cfgs] == [8, 16]  # 32 heads: 2 and 4 programs an SM (16 at most)
    _, long = ks_of(32, 32, skv=2048)   # past VDOT_MAX_KEYS: the tensor-core form wins
    assert long.vector_dot and vector_dot_configs(long) == []
    assert set(map(str, cfgs)) <= set(map(str, candidate_configs(one, "cuda")))
    assert "cuda-cores" in str(cfgs[0])
    gqa_kern, gqa = ks_of(64, 8)
    assert not gqa.vector_dot and "VDOT else" not in gqa.source and vector_dot_configs(gqa) == []
    with pytest.raises(ValueError, match="no CUDA-core form"):
        Launcher(gqa_kern.program, gqa, "interpreter",
                 TileConfig({"B_i": 8, "B_L": 16}, 4, 1, 3, vector_dot=True))


def _sm90(tmp_path, ks, kernel: str, launch, num_warps: int, num_stages: int) -> dict:
    """Kernel ``<name>_<kernel>`` of ``ks`` compiled for sm_90 with ``launch``'s constexprs
    (fp16 tensors, fp32 scratch, the one-launch form's int32 counters): ptxas's report."""
    path = tmp_path / f"{kernel}.py"
    path.write_text(ks.source)
    dtypes = ({p: "*fp16" for p in ks.params} | {f"{w}_ptr": "*fp32" for w in ks.scratch}
              | {"sem_ptr": "*i32"})
    spec = {"dtypes": dtypes, "constexprs": launch.consts, "num_warps": num_warps,
            "num_stages": num_stages, "resources": True}
    res = compile_for_sm90(path, f"{ks.name}_{kernel}", spec, timeout=300)
    assert res["ok"], res.get("error")
    return res


def test_cuda_core_form_compiles_for_sm90_without_spills(tmp_path):
    """The offered GPU form (one launch, 32 keys, 4 warps, B_P as the launcher picks)
    compiles for sm_90 -- the newest Triton's compiler; 3.6 on the GPU machine
    -- with no tensor-core instructions and no register spills."""
    kern = ne.superoptimize(_decode(32, 32, 512, "float16", d=128), target="interpreter",
                            cache=False)
    program, ks = next((p, k) for p, k in _rows(kern) if k.split_extent)
    (cfg,) = vector_dot_configs(ks)  # 512 keys: chunks of at least two blocks, 8 splits
    la = Launcher(program, ks, "interpreter", cfg)
    (launch,) = la._launches                       # the one launch, as the launcher plans it
    consts = launch.consts
    assert consts["B_IC"] == 1                     # its combine folds the one real row
    res = _sm90(tmp_path, ks, "fused", launch, cfg.num_warps, cfg.num_stages)
    assert consts["VDOT"] and not res["wgmma"] and res["spill_stores"] == 0, res


def test_one_launch_tensor_core_form_compiles_for_sm90_without_spills(tmp_path):
    """The one-launch split-k kernel's combine folds only the real rows (``B_IC``), in
    names of its own: Triton refuses a name re-typed under the ``if`` (a [16] row tile
    before it, [1] inside), which the interpreter does not check -- so compile for sm_90,
    with the launcher's constexprs, at 16 tensor-core rows and 64 keys."""
    kern = ne.superoptimize(_decode(32, 32, 2048, "float16", d=128), target="interpreter",
                            cache=False)
    program, ks = next((p, k) for p, k in _rows(kern) if k.split_extent)
    cfg = TileConfig({"B_i": 16, "B_L": 64}, 4, 3, 17, fused=True)
    la = Launcher(program, ks, "interpreter", cfg)
    (launch,) = la._launches
    # one real row: every partial (16 chunks of 128 keys) folds in one step of loads
    assert launch.consts["B_IC"] == 1 and launch.consts["B_P"] >= la._chunks[1] == 16
    res = _sm90(tmp_path, ks, "fused", launch, 4, 3)
    assert res["spill_stores"] == 0, res


@pytest.mark.parametrize("hq, hkv, rows", [(64, 8, 8), (32, 32, 1)], ids=["gqa-8-packed", "one-row"])
def test_two_launch_split_k_compiles_for_sm90(tmp_path, hq, hkv, rows):
    """The two-launch form's combine folds the real rows only (``B_IC``: 8 packed heads,
    or the one query), spread over the width, in one loop: both kernels compile for sm_90
    with the launcher's constexprs (Triton checks types the interpreter does not)."""
    kern = ne.superoptimize(_decode(hq, hkv, 2048, "float16", d=128), target="interpreter",
                            cache=False)
    program, ks = next((p, k) for p, k in _rows(kern) if k.split_extent)
    la = Launcher(program, ks, "interpreter", TileConfig({"B_i": 16, "B_L": 32}, 4, 3, 32))
    part, comb = la._launches
    assert comb.consts["B_IC"] == rows and comb.consts["B_P"] == 32  # all partials, one step
    for launch, name in ((part, "partial"), (comb, "combine")):
        res = _sm90(tmp_path, ks, name, launch, 4, 3)
        assert res["spill_stores"] == 0, res
