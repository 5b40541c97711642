"""Probe (session 21): hand edits of the generated Gluon backward sources, checked against
fp64 autograd and timed beside the generated ones, to learn which change pays before the
generator learns it.  Not part of the product.

The dK/dV edits that paid -- the row-vector loads issued before the ring waits, 240
registers per consumer -- are in ``lowering/gluon_sums.py`` since 50c11bb, so they left
this file; their numbers, probed on the generator of 3286a3f, are in
``bench/results/README.md`` (session 21).  What stays are the fused form's dQ experiments
(the cost of the atomic adds, wider adds, the bulk reduce Triton 3.6's Gluon lacks) and,
since session 33, FlashAttention-3's split of the adds off the consumers into a worker
partition (``adder_partition``; results in ``bench/results/s33/``).

    python bench/gluon_probe/backward_variants.py --out DIR
"""
import argparse
import dataclasses
import json
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import gluon_backward_validate as gbv  # noqa: E402
import triton  # noqa: E402


def sub(src, old, new, count=1):
    n = src.count(old)
    if n < count:
        raise ValueError(f"edit not applicable: {old[:70]!r} found {n}x")
    return src.replace(old, new)


def free_early(src):
    """Release the dSᵀ tile once dQ's product is complete, before the atomic adds."""
    src = sub(src, "        mbarrier.arrive(tfree0, count=1)\n", "")
    return sub(src, "d_v, d_k, sc0 = warpgroup_mma_wait(0, deps=(d_v, d_k, sc0, ))\n",
               "d_v, d_k, sc0 = warpgroup_mma_wait(0, deps=(d_v, d_k, sc0, ))\n"
               "        mbarrier.arrive(tfree0, count=1)\n")


def no_atomics(src):
    """Diagnostic only (wrong dQ): the adds dropped."""
    return re.sub(r"\n\s*gl\.atomic_add\(d_q_ptr[^\n]*", "", src)


def tma_reduce(src):
    """dQ's 64×64 tile through shared memory and the bulk engine's reduce-add
    (FlashAttention-3's way), double-buffered per warpgroup."""
    src = free_early(src)
    src = sub(src, "tbuf0, tfull0, tfree0, rows_bar", "tbuf0, tfull0, tfree0, dqbuf, dq_desc, rows_bar", 3)
    src = sub(src, "r0_desc, r1_desc, s0_desc, s1_desc, q_ptr", "r0_desc, r1_desc, s0_desc, s1_desc, dq_desc, q_ptr")
    src = sub(src, "    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())\n",
              "    dqbuf = gl.allocate_shared_memory(gl.float32, [4, 64, 64], dq_desc.layout)\n"
              "    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())\n")
    m = re.search(r"\n(\s*)gl\.atomic_add\(d_q_ptr[^\n]*", src)
    ind = m.group(1)
    new = (f"\n{ind}tma.store_wait(1)\n"
           f"{ind}dq_slot = dqbuf.index(WHICH * 2 + (g & 1))\n"
           f"{ind}dq_slot.store(gl.where(gl.convert_layout(mask_L, H_ROWS)[:, None], sc0, 0.0))\n"
           f"{ind}fence_async_shared()\n"
           f"{ind}tma.async_atomic_add(dq_desc, [((ax_z) * d_q_s0 + (ax_y) * d_q_s1) // d_q_s2 + l0, WHICH * 64], dq_slot)")
    src = src[:m.start()] + new + src[m.end():]
    return sub(src, "    gl.store(d_k_ptr", "    tma.store_wait(0)\n    gl.store(d_k_ptr")


def atomics_blocked(vec):
    """dQ's tile moved to a layout of ``vec`` contiguous fp32 per thread (a warp covers
    whole 64-column rows) before the atomic adds: wider, coalesced reductions."""
    def edit(src):
        m = re.search(r"gl\.atomic_add\(d_q_ptr \+ ([^\n]*)\n", src)
        line = m.group(0)
        cols_t = min(32, 64 // vec)
        rows_t = 32 // cols_t
        lay = f"gl.BlockedLayout([1, {vec}], [{rows_t}, {cols_t}], [4, 1], [1, 0])"
        new = line.replace("H_ROWS", "A_ROWS").replace("H_COLS", "A_COLS").replace(
            ", sc0, mask=", ", gl.convert_layout(sc0, A_LAYOUT), mask=").replace(
            "gl.atomic_add(d_q_ptr", "gl.atomic_add(0 + d_q_ptr")  # (edited: every_add's mark)
        ind = re.match(r"\s*", src[src.rfind("\n", 0, m.start()) + 1:]).group(0)
        head = (f"A_LAYOUT: gl.constexpr = {lay}\n{ind}A_ROWS: gl.constexpr = gl.SliceLayout(1, A_LAYOUT)\n"
                f"{ind}A_COLS: gl.constexpr = gl.SliceLayout(0, A_LAYOUT)\n{ind}")
        return src[:m.start()] + head + new + src[m.end():]
    edit.__name__ = f"atomics_blocked{vec}"
    return edit


def every_add(edit):
    """Apply an edit of the first atomic add to each of them (one per key loop)."""
    def run(src):
        n = src.count("gl.atomic_add(d_q_ptr")
        for _ in range(n):
            src = edit(src)
        assert "gl.atomic_add(d_q_ptr" not in src
        return src
    run.__name__ = edit.__name__
    return run


ASM = "gl.inline_asm_elementwise"


def atomics_v4(src):
    """dQ's tile in a layout of 4 contiguous fp32 per thread, added by one vector reduction
    (``red...add.v4.f32``, sm_90) per 4 values: Triton emits one scalar ``red`` per value."""
    m = re.search(r"gl\.atomic_add\((d_q_ptr \+ [^\n]*), sc0, mask=([^\n]*), sem='relaxed'\)\n", src)
    ptr, mask = m.group(1), m.group(2)
    ptr = ptr.replace("H_ROWS", "A_ROWS").replace("H_COLS", "A_COLS")
    mask = mask.replace("H_ROWS", "A_ROWS").replace("H_COLS", "A_COLS")
    ind = re.match(r"\s*", src[src.rfind("\n", 0, m.start()) + 1:]).group(0)
    asm = ("{ .reg .pred p; setp.ne.b32 p, $12, 0; "
           "@p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11}; "
           "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
    new = (f"A_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])\n"
           f"{ind}A_ROWS: gl.constexpr = gl.SliceLayout(1, A_LAYOUT)\n"
           f"{ind}A_COLS: gl.constexpr = gl.SliceLayout(0, A_LAYOUT)\n"
           f"{ind}dq_ptrs = ({ptr}).to(gl.int64)\n"
           f"{ind}dq_ok = ({mask}).to(gl.int32)\n"
           f"{ind}{ASM}({asm!r}, '=r,=r,=r,=r,l,l,l,l,f,f,f,f,r,r,r,r', "
           f"[dq_ptrs, gl.convert_layout(sc0, A_LAYOUT), dq_ok], dtype=gl.int32, is_pure=False, pack=4)\n")
    src = src[:m.start()] + new + src[m.end():]
    if ASM.startswith("tl.") and "import triton.language as tl" not in src:
        src = "import triton.language as tl\n" + src
    return src


def adder_partition(regs=96, warps=1, v4=True, early=False, reds=True, consumer_regs=None, chunk=16):
    """FlashAttention-3's split of dQ's adds off the consumers, without the bulk reduce
    Triton 3.6's Gluon lacks: each consumer warpgroup stores its 64×64 fp32 dQ tile to a
    double-buffered slot in shared memory (dqfull / dqfree mbarriers) and goes on; a
    worker partition of ``warps`` warps reads the slots back 16 rows at a time and adds
    them to dQ (one ``red.v4`` per 4 values with ``v4``, else ``gl.atomic_add``).
    ``early``: the whole slot is read into registers and released before the adds (so the
    release does not wait on them); ``reds=False``: no adds (diagnostic, wrong dQ);
    ``consumer_regs``: the consumers' register count; ``chunk``: rows read per step.
    The adder's warps share the producer's warpgroup, and a warpgroup runs at one register
    count (setmaxnreg): a worker count above the producer's 24 lowered the first
    consumer's to what was left (240 -> 168 with a 96-register adder: spills)."""
    def edit(src):
        src = sub(src, "tbuf0, tfull0, tfree0, rows_bar", "tbuf0, tfull0, tfree0, dqbuf, dqfull, dqfree, rows_bar", 3)
        src = sub(src, "    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())\n",
                  "    dqbuf = gl.allocate_shared_memory(gl.float32, [4, 64, 64], gl.NVMMASharedLayout("
                  "swizzle_byte_width=128, element_bitwidth=32, rank=2))\n"
                  "    dqfull = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())\n"
                  "    dqfree = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())\n"
                  "    for i in gl.static_range(4):\n"
                  "        mbarrier.init(dqfull.index(i), count=1)\n"
                  "        mbarrier.init(dqfree.index(i), count=1)\n"
                  "    rows_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())\n")
        n = 0
        while True:
            m = re.search(r"\n(\s*)gl\.atomic_add\(d_q_ptr[^\n]*", src)
            if not m:
                break
            ind = m.group(1)
            new = (f"\n{ind}dq_slot = WHICH * 2 + (g & 1)\n"
                   f"{ind}mbarrier.wait(dqfree.index(dq_slot), ((g >> 1) & 1) ^ 1)\n"
                   f"{ind}dqbuf.index(dq_slot).store(sc0)\n"
                   f"{ind}mbarrier.arrive(dqfull.index(dq_slot), count=1)")
            src = src[:m.start()] + new + src[m.end():]
            n += 1
        assert n >= 1
        if v4:
            asm = ("{ .reg .pred p; setp.ne.b32 p, $12, 0; "
                   "@p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11}; "
                   "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
            add = (f"            {ASM}({asm!r}, '=r,=r,=r,=r,l,l,l,l,f,f,f,f,r,r,r,r', "
                   "[ptrs.to(gl.int64), vals, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=4)\n")
        else:
            add = "            gl.atomic_add(ptrs, vals, mask=ok, sem='relaxed')\n"
        tpr = 16  # threads along a 64-column row (4 fp32 each)
        add = add if reds else ""
        chunk_body = (
            f"            for c in gl.static_range({64 // chunk}):\n"
            f"                vals = dqbuf.index(slot).slice(c * {chunk}, {chunk}, dim=0).load(A_LAYOUT)\n"
            f"                rows = l0 + c * {chunk} + gl.arange(0, {chunk}, A_ROWS)\n"
            "                cols = w * 64 + gl.arange(0, 64, A_COLS)\n"
            "                ptrs = base_ptr + rows[:, None] * d_q_s2 + cols[None, :] * d_q_s3\n"
            "                ok = (rows < n_L)[:, None] & (cols < 128)[None, :]\n"
            + add.replace("            ", "                ", 1) +
            "            mbarrier.arrive(dqfree.index(slot), count=1)\n")
        early_body = (
            "            vals = dqbuf.index(slot).load(A_LAYOUT)\n"
            "            mbarrier.arrive(dqfree.index(slot), count=1)\n"
            "            rows = l0 + gl.arange(0, 64, A_ROWS)\n"
            "            cols = w * 64 + gl.arange(0, 64, A_COLS)\n"
            "            ptrs = base_ptr + rows[:, None] * d_q_s2 + cols[None, :] * d_q_s3\n"
            "            ok = (rows < n_L)[:, None] & (cols < 128)[None, :]\n"
            + add)
        adder = (
            "@gluon.jit\n"
            "def _adder(dqbuf, dqfull, dqfree, j_lo, n_blocks, d_q_ptr, d_q_s0, d_q_s1, d_q_s2, d_q_s3, "
            "ax_z, ax_y, n_L, B_L: gl.constexpr):\n"
            f"    A_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [{32 // tpr}, {tpr}], [{warps}, 1], [1, 0])\n"
            "    A_ROWS: gl.constexpr = gl.SliceLayout(1, A_LAYOUT)\n"
            "    A_COLS: gl.constexpr = gl.SliceLayout(0, A_LAYOUT)\n"
            "    base_ptr = d_q_ptr + ax_z * d_q_s0 + ax_y * d_q_s1\n"
            "    for jb in range(n_blocks):\n"
            "        g = jb\n"
            "        l0 = j_lo + jb * B_L\n"
            "        for w in gl.static_range(2):\n"
            "            slot = w * 2 + (g & 1)\n"
            "            mbarrier.wait(dqfull.index(slot), (g >> 1) & 1)\n"
            + (early_body if early else chunk_body) + "\n\n")
        src = sub(src, "@gluon.jit\ndef _producer(", adder + "@gluon.jit\ndef _producer(")
        m = re.search(r"\n        \(_producer, \(([^\n]*)\)\),\n    \], \[4, 1\], \[(\d+), 24\]\)", src)
        src = (src[:m.start()] + m.group(0).split("\n    ], ")[0] +
               "\n        (_adder, (dqbuf, dqfull, dqfree, j_lo, n_blocks, d_q_ptr, d_q_s0, d_q_s1, d_q_s2, "
               "d_q_s3, ax_z, ax_y, n_L, B_L)),\n"
               f"    ], [4, 1, {warps}], [{consumer_regs or m.group(2)}, 24, {regs}])" + src[m.end():])
        return src
    edit.__name__ = (f"adder_r{regs}_w{warps}_k{chunk}_{'v4' if v4 else 'scalar'}{'_early' if early else ''}"
                     f"{'' if reds else '_noreds'}{f'_c{consumer_regs}' if consumer_regs else ''}")
    return edit


VARIANTS = {
    "kv": {"base": []},  # the generated dK/dV form, as a baseline
    "kvq": {"base": [], "free_early": [free_early], "no_atomics": [no_atomics],
            "tma_reduce": [tma_reduce],
            "at_blocked4": [every_add(atomics_blocked(4))],
            "at_blocked2": [every_add(atomics_blocked(2))],
            "at_blocked1": [every_add(atomics_blocked(1))],
            "at_v4": [every_add(atomics_v4)],
            # session 33: the adds in a worker partition.  Its warps share the producer's
            # warpgroup; one at 96 registers lowered the first consumer's to 168 (spills),
            # so these keep the warpgroup's count small (the _noreds one: the hand-off
            # through shared memory alone, wrong dQ)
            "adder_w1_r24": [adder_partition(24, 1, chunk=8)],
            "adder_w1_r24_noreds": [adder_partition(24, 1, chunk=8, reds=False)],
            "adder_w2_r40_k8": [adder_partition(40, 2, chunk=8, consumer_regs=232)],
            "adder_w4_r56": [adder_partition(56, 4, consumer_regs=224)]},
    "q": {"base": []},  # dQ's own kernel (the two-kernel backward's other half)
}


def with_source(kern, src):
    ks = kern.kernel_source
    g = dataclasses.replace(ks.gluon, source=src)
    return dataclasses.replace(kern, kernel_source=dataclasses.replace(ks, gluon=g))


def make(variant, d, dt, h, group, edits, values):
    kern = gbv.backward_kernel(variant, d, dt, h, group)
    src = kern.kernel_source.gluon.source
    for e in edits:
        src = e(src)
    kern = with_source(kern, src)
    prog, g, t = gbv.launchers(kern, values)
    if tma_reduce in edits:
        from triton.experimental.gluon import language as gl
        g._tiles.append(("d_q", [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32)))
    return kern, prog, g, t, src


def check(variant, group, name, edits, b, h, s, d, dtype):
    dt = getattr(torch, dtype)
    values = {"B": b, "L": s, "S": s}
    kern, prog, g, t, src = make(variant, d, dt, h, group, edits, values)
    ins, stat, dots, ref = gbv.inputs(kern, variant, b, h, s, d, dt)
    names = list(kern.program.outputs)
    best = None
    for sign in (-1.0, 1.0):
        ins.update({n: sign * dots for n in stat})
        out_t = gbv.fresh_outputs(prog)
        t({**ins, **out_t})
        e = max((out_t[n].double() - ref[n]).abs().max().item() for n in names)
        if best is None or e < best[0]:
            best = (e, sign)
    ins.update({n: best[1] * dots for n in stat})
    out_g = gbv.fresh_outputs(prog)
    g({**ins, **out_g})
    torch.cuda.synchronize()
    errs = {n: (out_g[n].double() - ref[n]).abs().max().item() for n in names}
    return {"case": "check", "variant": variant, "group": group, "edit": name, "S": s,
            "tl_err": best[0], "gluon_err": errs, "twin": g._twin is not None}


def timing(variant, group, name, edits, b, h, s, d, dtype):
    dt = getattr(torch, dtype)
    values = {"B": b, "L": s, "S": s}
    kern, prog, g, t, src = make(variant, d, dt, h, group, edits, values)
    ins = {n: torch.randn(b, h, s, d, device="cuda", dtype=dt) for n in ("q", "k", "v", "d_o")}
    ins["mx"] = torch.randn(b, h, s, device="cuda", dtype=torch.float32).abs() + 5
    for ph in prog.inputs:
        if ph.name not in ins:
            ins[ph.name] = torch.randn(tuple(ph.shape), device="cuda", dtype=getattr(torch, ph.dtype))
    outs = gbv.fresh_outputs(prog, 0.0)
    row = {"case": "timing", "variant": variant, "group": group, "edit": name, "S": s}
    forms = [("gluon", g)] + ([("tl", t)] if name == "base" else [])
    for form, la in forms:
        la({**ins, **outs})
        row[f"{form}_ms"] = triton.testing.do_bench(lambda: la({**ins, **outs}), warmup=25, rep=200)
    row["twin"] = g._twin is not None
    return row


def causes(e):
    out = []
    while e is not None and len(out) < 6:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", nargs="*", default=["kv", "kvq"])
    ap.add_argument("--variants", nargs="*", default=["plain", "causal"])
    ap.add_argument("--edits", nargs="*", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental import gluon as _g
    global ASM
    if not hasattr(_g.language, "inline_asm_elementwise"):
        ASM = "tl.inline_asm_elementwise"
    rows = [{"triton": triton.__version__, "device": torch.cuda.get_device_name(),
             "tma_async_atomic_add": hasattr(tma, "async_atomic_add"), "asm": ASM}]
    print(rows[0], flush=True)
    for group in a.groups:
        for name, edits in VARIANTS[group].items():
            if a.edits is not None and name not in a.edits:
                continue
            for variant in a.variants:
                jobs = [(check, (variant, group, name, edits, 1, 2, 1024, 128, "bfloat16")),
                        (timing, (variant, group, name, edits, 2, 16, 8192, 128, "bfloat16"))]
                if name == "no_atomics":
                    jobs = jobs[1:]
                for fn, args in jobs:
                    try:
                        row = fn(*args)
                    except Exception as e:  # noqa: BLE001
                        row = {"case": fn.__name__, "group": group, "edit": name,
                               "variant": variant, "error": f"{type(e).__name__}: {e}"[:2000],
                               "tb": traceback.format_exc()[-3000:],
                               "causes": [repr(c)[:1500] for c in causes(e)]}
                    print(json.dumps({k: v for k, v in row.items() if k != "tb"}), flush=True)
                    rows.append(row)
                    with open(os.path.join(a.out, "variants.json"), "w") as f:
                        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
