"""Probe (session 49): decode whose warps each take their own keys, by hand, before the
generator learns it.

The one-pass decode kernel the product derives (``bench/probe/decode_static_sm90.py``)
has Triton lay its four warps across the score tile's columns: every key block's row
max and row sum are reduced across warps through shared memory and P goes through
shared memory to the second product -- 9 CTA-wide barriers an iteration (Triton 3.6,
sm_90).  cuDNN's decode kernel (``..._16x128x128_1x4x1``) gives each warp its own keys.
This kernel does that with a batched (3-D) product: the key block is W chunks, chunk w
is warp w's, each chunk keeps its own running max, sum and output (split-k's fold
states, one per warp), and the chunks are merged once after the loop -- the combine of
split-k, inside one program.

    python bench/gluon_probe/decode_warp_split.py --check          # CPU (interpreter) or GPU
    python bench/gluon_probe/decode_warp_split.py --sm90 PYTHON    # the loop compiled offline
    python bench/gluon_probe/decode_warp_split.py --time           # GPU: beside the product and cuDNN

``--check`` compares it with an fp32 reference on odd lengths (a last block partly past
the keys, chunks with no key at all); ``--sm90`` counts its key loop's barriers as the
static probe counts the product's; ``--time`` times it, the product's kernel and cuDNN
on batched GQA decode (B=16, 32/8 heads, S=2000, bf16), graphed over copies of the
inputs larger than L2, as ``bench/offgrid_decode.py`` times its dram column.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__" and "--check" in sys.argv:
    import torch
    if not torch.cuda.is_available():  # the check runs in the interpreter (read at import)
        os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def warp_split_decode(q_ptr, k_ptr, v_ptr, o_ptr, q_sb, q_sh, k_sb, k_sh, k_ss, v_sb, v_sh,
                      v_ss, o_sb, o_sh, S, HKV, scale_log2,
                      G: tl.constexpr, B_i: tl.constexpr, D: tl.constexpr,
                      B_L: tl.constexpr, W: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    C: tl.constexpr = B_L // W
    rows = tl.arange(0, B_i)
    dd = tl.arange(0, D)
    ww = tl.arange(0, W)
    cc = tl.arange(0, C)
    q = tl.load(q_ptr + b * q_sb + (h * G + rows)[:, None] * q_sh + dd[None, :],
                mask=(rows < G)[:, None], other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (W, B_i, D))
    m3 = tl.full((W, B_i), -1e30, tl.float32)
    l3 = tl.zeros((W, B_i), tl.float32)
    acc = tl.zeros((W, B_i, D), tl.float32)
    kb = k_ptr + b * k_sb + h * k_sh
    vb = v_ptr + b * v_sb + h * v_sh
    for start in tl.range(0, S, B_L, num_stages=STAGES):
        keys = start + ww[:, None] * C + cc[None, :]                      # [W, C]: warp w's
        km = keys < S
        kt = tl.load(kb + keys[:, :, None] * k_ss + dd[None, None, :], mask=km[:, :, None],
                     other=0.0)                                            # [W, C, D]
        s = tl.dot(q3, tl.permute(kt, (0, 2, 1))) * scale_log2             # [W, B_i, C]
        s = tl.where(km[:, None, :], s, -1e30)
        m_new = tl.maximum(m3, tl.max(s, 2))                               # per warp: no exchange
        p = tl.where(km[:, None, :], tl.exp2(s - m_new[:, :, None]), 0.0)
        alpha = tl.exp2(m3 - m_new)
        l3 = l3 * alpha + tl.sum(p, 2)
        vt = tl.load(vb + keys[:, :, None] * v_ss + dd[None, None, :], mask=km[:, :, None],
                     other=0.0)                                            # [W, C, D]
        acc = acc * alpha[:, :, None] + tl.dot(p.to(vt.dtype), vt)         # [W, B_i, D]
        m3 = m_new
    m = tl.max(m3, 0)                     # the warps' states merged once (split-k's combine)
    f = tl.exp2(m3 - m[None, :])
    den = tl.sum(l3 * f, 0)
    o = tl.sum(acc * f[:, :, None], 0) / den[:, None]
    tl.store(o_ptr + b * o_sb + (h * G + rows)[:, None] * o_sh + dd[None, :],
             o.to(o_ptr.dtype.element_ty), mask=(rows < G)[:, None])


def launch(q, k, v, o, block_keys=64, warps=4, stages=3):
    """q, o (B, Hq, 1, D); k, v (B, Hkv, S, D), contiguous in the last dim."""
    b, hq, _, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    warp_split_decode[(b * hkv,)](
        q, k, v, o, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), s, hkv,
        math.log2(math.e) / math.sqrt(d), G=g, B_i=max(16, triton.next_power_of_2(g)), D=d,
        B_L=block_keys, W=warps, STAGES=stages, num_warps=warps)
    return o


def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    return (q.float() @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ vf


def check(device: str) -> list[dict]:
    import torch
    dt = torch.float16  # (the CPU interpreter's bf16 products are not right: fp16 there)
    rows = []
    for b, hq, hkv, s, d, bl in ((2, 8, 2, 70, 64, 64), (1, 4, 4, 200, 64, 64),
                                 (3, 32, 8, 333, 128, 64), (1, 7, 1, 130, 64, 128)):
        torch.manual_seed(0)
        q = torch.randn(b, hq, 1, d, device=device, dtype=dt) * 4  # scores far apart
        k, v = (torch.randn(b, hkv, s, d, device=device, dtype=dt) for _ in range(2))
        o = launch(q, k, v, torch.empty_like(q), block_keys=bl)
        err = (o.float() - reference(q, k, v)).abs().max().item()
        rows.append({"case": f"B={b} {hq}/{hkv} S={s} D={d} keys={bl}", "max_err": err,
                     "ok": err < 1e-2})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sm90(python: str) -> list[dict]:
    """The kernel compiled for sm_90 under ``python``'s Triton; its key loop counted."""
    here = Path(__file__).resolve()
    sys.path.insert(0, str(here.parents[2] / "tests"))
    sys.path.insert(0, str(here.parents[1] / "probe"))
    from sm90_compile import compile_for_sm90
    from decode_static_sm90 import loop_counts
    rows = []
    names = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "q_sb", "q_sh", "k_sb", "k_sh", "k_ss",
             "v_sb", "v_sh", "v_ss", "o_sb", "o_sh"]
    for bl, stages in ((64, 4), (128, 3)):
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"dtypes": {n: "*bf16" for n in names[:4]} | {"scale_log2": "fp32"},
                    "constexprs": {"G": 4, "B_i": 16, "D": 128, "B_L": bl, "W": 4, "STAGES": stages},
                    "num_warps": 4, "num_stages": stages, "resources": True,
                    "divisible": names, "dump": tmp}
            res = compile_for_sm90(here, "warp_split_decode", spec, python=python)
            counts = loop_counts((Path(tmp) / "warp_split_decode.sass").read_text()) \
                if res.get("ok") else {}
        row = {"keys": bl, "stages": stages, "ok": res.get("ok"), "error": res.get("error"),
               "registers": res.get("registers"), "spill_stores": res.get("spill_stores"),
               "shared": res.get("shared"), **counts}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def time_gpu() -> list[dict]:
    """Ours (warp split) at four tiles, the product's kernel and SDPA's backends, graphed
    over copies of the inputs larger than L2: TB/s of K+V."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import neptune_eq as ne
    from offgrid_decode import decode_of, peer_args
    from offgrid import sdpa_peers
    from neptune_eq.runtime.timing import copy_inputs, device_ms, input_copies, l2_bytes
    setup = (16, 32, 8, 2000, 128)
    prog, (q, k, v) = decode_of(setup, "bfloat16")
    kern = ne.superoptimize(prog, target="cuda", top_k=2)
    ref = reference(q, k, v)
    copies = copy_inputs([q, k, v], input_copies([q, k, v], l2_bytes(q.device)))
    outs = [torch.empty_like(c[0]) for c in copies]
    fns = {"product " + str(kern.config): [lambda c=c: kern(*c) for c in copies]}
    for bl, st in ((64, 3), (64, 4), (128, 2), (128, 3)):
        fns[f"warp split keys={bl} stages={st}"] = [
            lambda c=c, o=o, bl=bl, st=st: launch(*c, o, bl, 4, st) for c, o in zip(copies, outs)]
    for name, (fn, note) in sdpa_peers(q, k, v, 4).items():
        fns[name] = [lambda a=peer_args(c, 4, note), fn=fn: fn(*a) for c in copies]
    work = 2 * 16 * 8 * 2000 * 128 * 2 / 1e12
    rows = []
    for name, calls in fns.items():
        err = (calls[0]().float() - ref).abs().max().item()
        ms = device_ms(lambda f: f[0](), [[f] for f in calls])
        rows.append({"kernel": name, "tb_s": work / (ms / 1e3), "max_err": err})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sm90", metavar="PYTHON", default=None)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    rows = []
    if a.check:
        import torch
        rows += check("cuda" if torch.cuda.is_available() else "cpu")
    if a.sm90:
        rows += sm90(a.sm90)
    if a.time:
        rows += time_gpu()
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
