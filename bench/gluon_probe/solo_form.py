"""The one-consumer Gluon form (64-row programs, two or three per SM) against the
two-consumer form and the ``tl`` 64x64 tiles, per case, each Gluon config also launched
heads first where it runs one program per tile (``gluon_tiles.grid_order``), timed
alternately in one process (issues 16, 17).

    python bench/gluon_probe/solo_form.py [--rounds 3] [--cases doc13 jagged causal64 ...]

Cases: the document masks of ``doc_mask_gpu`` (H=16 D=128, fp16) at S = 8192 and 32768,
``causal64`` (B=4 H=16 S=5000 D=64: the off-grid row below goal), ``causal128``
(B=1 H=16 S=8192 D=128) and the other ``AFFINE`` cases (``alibi8k`` / ``alibi32k``: ALiBi
prefill as bench/neptune_ops.py runs it, session 38).  Each round times every Gluon config the chooser would and the
``tl`` 64x64 config (``time_configs``: a Gluon form's outputs are checked against the
``tl`` run before it).  Prints one JSON line per (case, round, config) and a summary of
medians per case; also the compiled programs' registers and shared memory.  The
one-consumer form is on in the product since session 38 (``gluon_ws.SOLO``); this probe
turns it on whatever the environment says.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402

from neptune_eq.dropin import flex as ne_flex  # noqa: E402
from neptune_eq.lowering import gluon_ws  # noqa: E402
from neptune_eq.runtime.launcher import check_inputs  # noqa: E402
from neptune_eq.runtime.tile_configs import TileConfig, gluon_configs  # noqa: E402
from neptune_eq.runtime.tuning import time_configs  # noqa: E402
from neptune_eq.sizes import sizes_of  # noqa: E402

# name: (B, Hq, Hkv, S, D, causal)
AFFINE = {"causal64": (4, 16, 16, 5000, 64, True), "causal128": (1, 16, 16, 8192, 128, True),
          "causal32k": (1, 16, 16, 32768, 128, True),
          "gqa512": (1, 64, 8, 512, 128, False), "global512": (1, 32, 32, 512, 128, False),
          "causal512": (1, 32, 32, 512, 128, True), "gqa64_3000": (4, 16, 8, 3000, 64, True),
          "global64": (4, 16, 16, 5000, 64, False), "gqa64_5000": (2, 32, 16, 5000, 64, False),
          "alibi8k": (1, 32, 32, 8192, 128, False), "alibi32k": (1, 32, 32, 32768, 128, False)}
# score mods of the affine cases that have one: ALiBi with bench/neptune_ops.py's slopes
SLOPES = [2.0 ** (-8.0 * (k + 1) / 32) for k in range(32)]


def setup(name: str, S: int):
    """(launcher, bound inputs, size values, visible pairs, head dim) of one case."""
    hkv = None
    if name in AFFINE:
        B, H, hkv, S, D, causal = AFFINE[name]
        mask = (lambda b, h, q, kv: q >= kv) if causal else None
        pairs = B * H * (S * (S + 1) / 2 if causal else S * S)
    else:
        H, D = dm.H, dm.D
        mask, B, pairs = dm.case(name, S)
        pairs *= H
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, hkv or H, S, D, device="cuda", dtype=torch.float16) for _ in range(2))
    spec = ne_flex.check(q, k, v, None, hkv not in (None, H), False)
    sizes = {"B": B, "L": S, "S": S}
    slopes = torch.tensor(SLOPES, device="cuda")

    def alibi(s, b, h, i, j):
        return s + slopes[h] * (j - i)
    st, captured = ne_flex.trace(spec, alibi if name.startswith("alibi") else None, mask, sizes)
    kern = st.kernel_at(sizes)
    prog = kern.input_program
    bound = check_inputs(prog, (q, k, v, *captured.values()), {}, "cuda", symbolic=True)
    values = sizes_of(prog, bound)
    la = kern._dispatch.launcher(values) if kern._dispatch else kern._launcher
    for out in prog.outputs:  # as a call binds them (a sweep times whole launches)
        dims = [values[n.name] if hasattr(n, "name") else n for n in prog.shape_of(out)]
        bound[out] = torch.empty(dims, dtype=getattr(torch, prog.dtype_of(out)), device="cuda")
    return la, bound, values, pairs, D, kern


def compiled(la, bound, cfgs) -> dict:
    """Registers a thread at launch, spills and shared memory of each Gluon config's kernel
    (what decides how many programs an SM holds)."""
    from neptune_eq.runtime.gluon_launch import GluonLauncher
    out = {}
    for c in cfgs:
        if not c.gluon_ws or c.per_tile or c.heads_first:  # (launch choices: one kernel)
            continue
        g = GluonLauncher(la.program, la.ks, "cuda", c, la.size_args)
        args = g._args(g._summarised(dict(bound))[0])[0]
        ck = g.fn.warmup(*args, grid=g.grid, **g.consts, **g.options)
        ck._init_handles()
        out[str(c)] = {"regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared,
                       "programs_per_sm": g.form.programs_per_sm(c.blocks["B_L"], c.num_stages)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--cases", nargs="*", default=["doc13", "jagged", "doc4", "doc64",
                                                   "causal64", "causal128"])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    gluon_ws.SOLO = True  # (read when a form is generated; part of the cache key)
    for name in a.cases:
        for S in ([0] if name in AFFINE else a.S):
            la, bound, values, pairs, D, _ = setup(name, S)
            rows = f"B_{la.ks.block_axis}"
            cfgs = [TileConfig({rows: 64, "B_L": 64}, 4, 3)] + gluon_configs(la.ks)
            cfgs = [c.at(values) for c in cfgs]
            chosen = la.config.at(values)  # the cold choice of the structure's first call
            cfgs += [] if chosen in cfgs else [chosen]
            print(json.dumps({"case": name, "S": S, "chosen": str(chosen)}), flush=True)
            times: dict = {}
            for rnd in range(a.rounds):
                for c, ms, why in time_configs(la.program, la.ks, "cuda", bound, cfgs, values):
                    times.setdefault(str(c), []).append(ms)
                    print(json.dumps({"case": name, "S": S, "round": rnd, "config": str(c),
                                      "ms": ms, "why": why or ""}), flush=True)
            med = {c: statistics.median(v) for c, v in times.items() if None not in v}
            best = min(med.values())
            print(json.dumps({"case": name, "S": S, "summary": {
                c: [round(m, 4), round(best / m, 3),
                    round(4 * D * pairs / (m * 1e-3) / 1e12, 1)] for c, m in med.items()}}),
                flush=True)
            print(json.dumps({"case": name, "S": S, "compiled": compiled(la, bound, cfgs)}),
                  flush=True)

if __name__ == "__main__":
    main()
