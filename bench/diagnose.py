"""Where the time goes: host overhead vs GPU time, and what the compiler made of a kernel.

    python bench/diagnose.py overhead [--ops causal-dc alibi-dc ...] [--seqs 512 2048]
    python bench/diagnose.py compiled [--ops global-pf] [--seqs 8192] [--wide]
    python bench/diagnose.py loop --ops global-pf --seqs 8192   # for ncu: a few launches
    python bench/diagnose.py launchab --ops causal-dc gqa-dc --seqs 512 2048
    python bench/diagnose.py hostsplit --ops gqa-pf --seqs 512 2048

``overhead`` times each call three ways: ``do_bench`` of the full call (what
neptune_ops.py reports), ``do_bench_cudagraph`` (GPU time only: launches replayed from a
CUDA graph) and the host time per call (a loop of calls without synchronising).  When
the host time exceeds the GPU time, the call is launch-bound and a faster kernel cannot
show.  The same for SDPA and FlexAttention.
``compiled`` prints every timed config of the chosen candidate with registers, spills,
shared memory and whether the tensor-core ops are Hopper ``wgmma``; with ``--wide`` also
a grid of pointer-load tiles wider than the offered one (row blocks 32-128 x key blocks
32-128 x 4/8 warps x 2-5 stages), to see whether the offered grid holds the best tile.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parent))
import neptune_ops as nb  # noqa: E402

import neptune_eq as ne  # noqa: E402


PEERS = True


def _host_us(fn, n=200):
    from host_profile import loop_us
    return loop_us(fn, n)


def _setup(op, S):
    out, spec, work, unit = nb.build(op, S)
    q, k, v, slopes, args = nb.make_inputs(spec)
    kern = ne.superoptimize(out, target="cuda", top_k=2)
    return kern, args, spec, (q, k, v, slopes), work, unit


def overhead(op, S):
    kern, args, spec, qkvs, work, unit = _setup(op, S)
    rows = [("neptune_eq", lambda: kern(*args))]
    if kern._launcher is not None:
        bound = dict(zip([p.name for p in kern.program.inputs], args))
        outs = {n: torch.empty(kern.program.shape_of(n), dtype=torch.float16, device="cuda")
                for n in kern.program.outputs}
        rows.append(("  launcher only", lambda: kern._launcher({**bound, **outs})))
    if PEERS:
        rows += list(nb.peers(spec, *qkvs).items())
    print(f"{op} S={S}: chosen {kern.chosen_row.structure} [{kern.config}]")
    for name, fn in rows:
        try:
            fn()
            call = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
            graph = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
            host = _host_us(fn)
            print(f"  {name:<16} call {call:8.1f} us  gpu(graph) {graph:8.1f} us  host {host:8.1f} us"
                  f"  -> {work / (graph * 1e-6):.2f} {unit} on the GPU alone", flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"  {name:<16} failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
    la = kern._launcher
    print(f"    fast launch: {la.fast_ok} {la.fast_reason} checked keys {len(la._checked)}")
    from host_profile import kernel_times
    for name, us, _ in kernel_times(lambda: kern(*args), warmup=1):
        print(f"    GPU kernel {name[:60]:<60} {us:8.1f} us")
    for c in kern.candidates:
        print(f"    cand #{c.rank} {c.structure} predicted {c.predicted_us:.1f} us measured "
              f"{'—' if c.measured_ms is None else f'{c.measured_ms * 1e3:.1f} us'} {c.status}")


WIDE = False


def wide_grid(ks) -> list:
    """Pointer-load tiles beyond ``candidate_configs``' handful (``--wide``)."""
    from neptune_eq.runtime.tile_configs import TileConfig, _tiled_blocks
    out = []
    for bi in (32, 64, 128):
        for bl in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3, 4, 5):
                    if bi * bl > 128 * 64 and st > 3 or bi < 16 * w // 4 * 2 and w == 8:
                        continue  # (shared memory; 8 warps need 32+ rows)
                    out.append(TileConfig({k: bi if k == f"B_{ks.block_axis}" else bl
                                           for k in _tiled_blocks(ks)}, w, st))
    return out


def compiled(op, S):
    """Every config the timer may compile (pointer, TMA, warp-specialised; pruned as the
    timer prunes them): time, registers, spills, shared memory, and what the PTX uses.
    Also written to bench/results/diagnose/compiled_<op>_<S>.json."""
    import json
    from neptune_eq.choosing.choose import prune_configs
    from neptune_eq.choosing.costmodel import device_for
    from neptune_eq.runtime.gluon_launch import make_launcher
    from neptune_eq.runtime.tile_configs import candidate_configs
    kern, args, *_ = _setup(op, S)
    bound = dict(zip([p.name for p in kern.program.inputs], args))
    outs = {n: torch.empty(kern.program.shape_of(n), dtype=torch.float16, device="cuda")
            for n in kern.program.outputs}
    tensors = {**bound, **outs}
    ks = kern.kernel_source
    print(f"{op} S={S}: {kern.chosen_row.structure}; chosen [{kern.config}]")
    configs = prune_configs(kern.plan, candidate_configs(ks, "cuda"),
                            device_for(torch.cuda.get_device_name()))
    if WIDE:
        seen = {str(c) for c in configs}
        configs += [c for c in wide_grid(ks) if str(c) not in seen]
    records = []
    for cfg in configs:
        try:
            la = make_launcher(kern.program, ks, "cuda", cfg)  # (a gluon-ws config: the Gluon form)
            la(tensors)
            ms = do_bench(lambda: la(tensors), warmup=25, rep=100, return_mode="median")
            for name, ck in _kernels_run(la):
                ptx = ck.asm.get("ptx", "")
                rec = {"config": str(cfg), "us": ms * 1e3, "kernel": name,
                       "regs": ck.n_regs, "spills": ck.n_spills, "smem": ck.metadata.shared,
                       "wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx,
                       "tma": "cp.async.bulk.tensor" in ptx, "setmaxnreg": "setmaxnreg" in ptx}
                records.append(rec)
                print(f"  [{cfg}] {ms * 1e3:8.1f} us  {name}: regs {ck.n_regs} spills "
                      f"{ck.n_spills} smem {ck.metadata.shared} wgmma {rec['wgmma']} "
                      f"mma.sync {rec['mma_sync']} tma {rec['tma']} setmaxnreg {rec['setmaxnreg']}",
                      flush=True)
        except Exception as ex:  # noqa: BLE001
            msg = [x for x in str(ex).strip().splitlines() if x.strip()]
            records.append({"config": str(cfg), "failed": (msg[-1] if msg else type(ex).__name__)[:300]})
            print(f"  [{cfg}] failed: {type(ex).__name__}: {records[-1]['failed'][:160]}", flush=True)
    out = Path(__file__).parent / "results" / "diagnose"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"compiled_{op}_{S}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "chosen": str(kern.config), "configs": records}, indent=1))


def _kernels_run(la) -> list:
    """(name, CompiledKernel) of each kernel a launcher's calls run: those its checked fast
    launch keeps (the very kernels of this config), else the last each JIT function
    compiled (right only for a config compiled first in this process)."""
    run = getattr(la, "_pointer_twin", None) or la  # a TMA config on unaligned inputs
    checked = [v for k, v in run._checked.items() if k != "failed"]
    if checked:
        cks = [ck for ck in checked[0] if ck is not None and hasattr(ck, "n_regs")]
        return [(ck.name, ck) for ck in cks]
    fns = getattr(run, "fns", None) or [run.fn]
    return [(fn.__name__, ck) for fn in fns
            for ck in [c for cache in fn.device_caches.values() for c in cache[0].values()][-1:]]


def hostprofile(op, S, n=2000):
    """cProfile of n calls (host side): where the per-call microseconds go."""
    from host_profile import host_profile
    kern, args, *_ = _setup(op, S)
    host_us, table = host_profile(lambda: kern(*args), n, top=14)
    print(f"{op} S={S}: [{kern.config}] fast {kern._launcher.fast_ok} {kern._launcher.fast_reason}"
          f" host {host_us:.1f} us per call")
    print(table)


def loop(op, S, n=5):
    """Ours n times, then each peer n times (for ncu's --launch-skip/--launch-count)."""
    kern, args, spec, qkvs, *_ = _setup(op, S)
    for name, fn in [("neptune_eq", lambda: kern(*args))] + list(nb.peers(spec, *qkvs).items()):
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        print(f"{op} S={S}: {n} launches of {name} done", flush=True)


def launchab(op, S, rounds=6):
    """Host microseconds per warm call (a loop without sync, ``host_profile.loop_us``) of
    session 31's launch changes, alternated ``rounds`` times in this process: ``before``
    (Triton 3.6's empty hook chains passed to every launch, with its metadata made;
    ``CompiledKernel.run`` called; so no Gluon descriptor is encoded once either),
    ``hooks`` (empty chains passed as None, and so Gluon descriptors encoded once per
    address) and ``raw`` (and the compiled launcher called directly,
    ``launch.raw_launcher``).  The outputs of every mode must be bit-identical."""
    from host_profile import launch_settings
    kern, args, *_ = _setup(op, S)
    modes = {"before": (False, False, False), "hooks": (True, False, True),
             "raw": (True, True, True)}
    got, outs = {m: [] for m in modes}, {}
    restore = launch_settings()
    try:
        for _ in range(rounds):
            for mode, switches in modes.items():
                launch_settings(*switches)
                got[mode].append(_host_us(lambda: kern(*args)))
                outs[mode] = kern(*args)
    finally:
        restore()
    same = all(torch.equal(outs[m], outs["before"]) for m in outs)
    med = {m: sorted(x)[len(x) // 2] for m, x in got.items()}
    print(f"{op} S={S} [{kern.config}]: host us per call, median of {rounds} alternated -- "
          + ", ".join(f"{m} {med[m]:.1f} ({' '.join(f'{x:.0f}' for x in got[m])})" for m in got)
          + f"; outputs bit-identical: {same}", flush=True)


def hostsplit(op, S):
    """Host microseconds per warm call (a loop without sync), cut at the layers of our
    call path, beside SDPA's whole call: the call (``Kernel.__call__``), its replay alone
    (``bound_call`` / ``gluon_launch``: outputs, arguments, launches), the signature it is
    looked up by, and the outputs' allocation alone."""
    from neptune_eq.api import _signature
    from neptune_eq.runtime.launch import written_outputs
    kern, args, spec, qkvs, *_ = _setup(op, S)
    kern(*args)
    replay = kern._bound.get(_signature(args))
    rows = [("call", lambda: kern(*args))]
    if replay:
        rows += [("replay", lambda: replay(list(args))),
                 ("signature", lambda: _signature(args)),
                 ("outputs", lambda: written_outputs(replay.out_specs, replay.device))]
    hq, hkv, sq, _, _, alibi, softcap, masked, _ = spec
    if PEERS and not (alibi or softcap):  # SDPA alone (nb.peers would compile the others)
        q, k, v, _ = qkvs
        rows.append(("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=masked and sq > 1, enable_gqa=hq > hkv)))
    got = {n: [] for n, _ in rows}
    for _ in range(5):  # alternated: the host's drift falls on every row
        for name, fn in rows:
            got[name].append(_host_us(fn))
    print(f"{op} S={S} [{kern.config}] {type(replay).__name__}: host us per call, median of 5 -- "
          + ", ".join(f"{n} {sorted(x)[2]:.1f}" for n, x in got.items()), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["overhead", "compiled", "loop", "hostprofile", "launchab",
                                     "hostsplit"])
    ap.add_argument("--ops", nargs="+", default=["causal-dc", "alibi-dc", "gqa-dc"],
                    choices=list(nb.OPS))
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--wide", action="store_true", help="compiled: also a wider tile grid")
    a = ap.parse_args()
    global PEERS, WIDE
    PEERS, WIDE = not a.no_peers, a.wide
    fn = {"overhead": overhead, "compiled": compiled, "loop": loop, "hostprofile": hostprofile,
          "launchab": launchab, "hostsplit": hostsplit}[a.what]
    for S in a.seqs:
        for op in a.ops:
            try:
                fn(op, S)
            except Exception as ex:  # noqa: BLE001
                print(f"{op} S={S}: FAILED {type(ex).__name__}: {ex}", flush=True)


if __name__ == "__main__":
    main()
