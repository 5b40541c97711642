"""Generate the global-attention kernel sources the WS probe runs on the GPU (CPU only).

    TRITON_INTERPRET=1 python bench/ws_probe/gen_sources.py [--check]

For each shape, the rolling (one-pass, non-split) candidate's plan is lowered for CUDA
(``kernelgen.generate``: bf16 dots stay bf16) and written as ``kernels/<shape>_base.py``,
with variants made by string transforms of that source:

* ``peel``   -- the warp-specialised main loop runs over whole key blocks only, with its
  key mask constant-true; a plain ``range`` loop after it takes the one partial block
  with the masks (what Triton's tutorial does by giving the masked block its own stage);
* ``accdot`` -- the P@V product accumulates into the rescaled state inside ``tl.dot``
  (``tl.dot(p, v, o * alpha)``) instead of ``o * alpha + tl.dot(p, v)``;
* ``both``   -- the two together.

``--check`` runs every variant once in the Triton interpreter at a small odd shape and
compares it with torch (the transforms must not change the result).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import neptune_eq as ne
from neptune_eq.lowering import kernelgen

HERE = Path(__file__).resolve().parent
SHAPES = {  # name -> (B, H, S, D, dtype)
    "A": (2, 4, 1000, 128, "float16"),    # global fp16 S=1000 D=128 (NaN at B_L=64 WS)
    "B": (3, 2, 3000, 64, "bfloat16"),    # global bf16 S=3000 D=64
    "C": (1, 2, 333, 64, "float16"),      # global fp16 S=333 D=64 (inputs x30)
    "E": (2, 4, 1024, 128, "float16"),    # even: no partial key block
    "P": (1, 32, 8192, 128, "float16"),   # the timed shape
    "T": (1, 2, 77, 64, "float16"),       # interpreter check only
    "K": (1, 4, 777, 128, "float16"),     # causal (mask j <= i): is it specialised at all?
}

_HEAD = re.compile(r"^( *)for l0 in tl\.range\((.+), (.+), B_L, num_stages=(.+), "
                   r"warp_specialize=WS\):$")


def _main_loop(lines: list[str]) -> tuple[int, int, str, str, str]:
    """(header index, end index (exclusive), indent, lo, hi) of the one WS main loop."""
    heads = [i for i, ln in enumerate(lines) if _HEAD.match(ln)]
    assert len(heads) == 1, heads
    i = heads[0]
    ind, lo, hi, _ = _HEAD.match(lines[i]).groups()
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > len(ind)):
        j += 1
    return i, j, ind, lo, hi


def peel(src: str) -> str:
    lines = src.splitlines()
    i, j, ind, lo, hi = _main_loop(lines)
    body = lines[i + 1:j]
    mask = [k for k, ln in enumerate(body) if "mask_L = (offs_L <" in ln and "| EVEN_L" in ln]
    assert len(mask) == 1
    whole = list(body)
    whole[mask[0]] = whole[mask[0]].replace("| EVEN_L", "| True")
    new = [f"{ind}l_whole = {lo} + (({hi}) - ({lo})) // B_L * B_L",
           f"{ind}for l0 in tl.range({lo}, l_whole, B_L, num_stages=LOOP_STAGES, warp_specialize=WS):",
           *whole,
           f"{ind}for l0 in range(l_whole, {hi}, B_L):",
           *body]
    return "\n".join(lines[:i] + new + lines[j:]) + "\n"


_DOT = re.compile(r"^( *)(t\d+) = tl\.dot\((.+)\)$")


def accdot(src: str) -> str:
    lines = src.splitlines()
    i, j, ind, lo, hi = _main_loop(lines)
    out = list(lines)
    done = 0
    for k in range(i + 1, j):
        m = _DOT.match(lines[k])
        if not m:
            continue
        var = m.group(2)
        upd = [u for u in range(k + 1, j) if re.match(rf"^ *(\w+)_new = (\w+) \* (t\d+)\[:, None\] \+ {var}$",
                                                       lines[u])]
        if not upd:
            continue
        u = upd[0]
        mu = re.match(rf"^( *)(\w+)_new = (\w+) \* (t\d+)\[:, None\] \+ {var}$", lines[u])
        out[k] = ""
        out[u] = f"{mu.group(1)}{mu.group(2)}_new = tl.dot({m.group(3)}, {mu.group(3)} * {mu.group(4)}[:, None])"
        done += 1
    assert done == 1, done
    return "\n".join(ln for ln in out if ln != "") + "\n"


VARIANTS = {"base": lambda s: s, "peel": peel, "accdot": accdot, "both": lambda s: accdot(peel(s))}


def rolling_source(shape, causal=False) -> kernelgen.KernelSource:
    b, h, s, d, dt = shape
    mask = (lambda b, h, i, j: j <= i) if causal else None
    k = ne.superoptimize(ne.attention(b, h, s, s, d, dt, mask_mod=mask), target="interpreter",
                         cache=False)
    rows = [c for c in k.candidates if c.plan is not None and not c.plan.split
            and c.kernel is not None and c.kernel.descriptors and c.description.startswith("rolling")]
    return kernelgen.generate(rows[0].plan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    out = HERE / "kernels"
    out.mkdir(exist_ok=True)
    manifest = {}
    for name, shape in SHAPES.items():
        ks = rolling_source(shape, causal=name == "K")
        manifest[name] = {"shape": shape, "kernel": ks.name, "row_extent": ks.row_extent,
                          "grid_size": ks.grid_size, "tunables": ks.tunables,
                          "even_flags": ks.even_flags, "params": ks.params,
                          "stride_params": ks.stride_params, "ws": list(ks.warp_specializable)}
        for v, f in VARIANTS.items():
            if name == "K" and v != "base":
                continue
            (out / f"{name}_{v}.py").write_text(f(ks.source))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if a.check:
        check(manifest)


def check(manifest):
    """Every variant of shape T and C in the interpreter, against torch in fp32."""
    import importlib.util
    import torch
    import triton
    for name in ("T", "C"):
        m = manifest[name]
        b, h, s, d, dt = m["shape"]
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, generator=g).to(getattr(torch, dt)) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for var in VARIANTS:
            for bi, bl in ((16, 16), (32, 64)):
                spec = importlib.util.spec_from_file_location(f"k_{name}_{var}", HERE / "kernels" / f"{name}_{var}.py")
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                fn = getattr(mod, m["kernel"])
                o = torch.full_like(q, float("nan"))
                t = {"q": q, "k": k, "v": v, "o": o}
                strides = [t[n].stride(i) for n, i in m["stride_params"]]
                consts = dict(m["tunables"], B_i=bi, B_L=bl, TMA=True, WS=True, LOOP_STAGES=2)
                for flag, (blk, ext) in m["even_flags"].items():
                    consts[flag] = all(e % consts[blk] == 0 for e in ext)
                triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
                fn[(triton.cdiv(m["row_extent"], bi), m["grid_size"])](q, k, v, o, *strides, **consts)
                err = (o.float() - ref).abs().max().item()
                print(f"interp {name} {var:6s} B_i={bi} B_L={bl}: max err {err:.2e}", flush=True)
                assert err < 1e-2, err


if __name__ == "__main__":
    main()
