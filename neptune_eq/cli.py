"""``neptune-eq`` command line: ``demo``, ``optimize``, ``explain``, ``bench``, ``rules``.

``demo`` superoptimizes a small plain attention and shows why; ``optimize`` / ``explain`` /
``bench`` take an attention variant from flags or a Python file defining ``program()``."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import torch

    import neptune_eq as ne
    from neptune_eq.frontend import examples
    from neptune_eq.interp import evaluate

    if args.op == "softmax":
        out = examples.softmax(args.seq_q, args.seq_kv, "float32")
    else:
        out = examples.attention(args.batch, args.heads, args.seq_q, args.seq_kv, args.head_dim,
                                 args.dtype)
    t0 = time.perf_counter()
    kern = ne.superoptimize(out, target=args.target)
    t1 = time.perf_counter()
    print(f"== neptune_eq demo: plain {args.op} on target '{kern.target}' "
          f"(superoptimized in {t1 - t0:.2f} s)\n")
    print("== rewrite trace")
    print(kern.trace, "\n")
    print("== derivation summary")
    print(kern.explain(), "\n")
    print("== generated Triton source")
    print(kern.source)
    torch.manual_seed(0)
    prog = kern.input_program
    dev = "cuda" if kern.target == "cuda" else "cpu"
    ins = {ph.name: torch.randn(ph.shape).to(getattr(torch, ph.dtype)).to(dev)
           for ph in prog.inputs}
    got = kern(**ins)
    ref = evaluate(prog, {k: v.cpu() for k, v in ins.items()})[prog.outputs[0]]
    err = (got.double().cpu() - ref).abs().max().item()
    print(f"== check: max |kernel - fp64 reference interpreter| = {err:.3e} "
          f"(output dtype {prog.dtype_of(prog.outputs[0])})")
    return 0 if err < 2e-2 else 1


def _program_from_args(args):
    """The program of ``optimize``/``explain``/``bench``: a Python file defining
    ``program()`` (returning ne.compute outputs), or an attention variant from flags."""
    import neptune_eq as ne
    if args.file:
        import runpy
        from pathlib import Path
        if not Path(args.file).is_file():
            raise ValueError(f"expected a Python file defining program(), got {args.file!r} "
                             "(no such file).")
        try:
            mod = runpy.run_path(args.file)
        except Exception as e:  # noqa: BLE001 - the user's file failed, not neptune_eq
            raise ValueError(f"running {args.file} raised {type(e).__name__}: {e}; fix the "
                             "file (--debug shows the traceback).") from e
        if "program" not in mod or not callable(mod["program"]):
            raise ValueError(f"{args.file} must define program() returning the output "
                             "tensor(s) built with neptune_eq (got names: "
                             f"{sorted(k for k in mod if not k.startswith('_'))}).")
        return mod["program"]()
    cap, win, causal = args.softcap, args.window, args.causal
    off = args.seq_kv - args.seq_q

    def score_mod(s, b, h, i, j):
        return ne.tanh(s / cap) * cap

    def mask_mod(b, h, i, j):
        m = j <= i + off
        return (m & (i + off - j < win)) if win else m
    return ne.attention(args.batch, args.heads, args.seq_q, args.seq_kv, args.head_dim, args.dtype,
                        kv_heads=args.kv_heads, score_mod=score_mod if cap else None,
                        mask_mod=mask_mod if (causal or win) else None)


def _superoptimize(args):
    import neptune_eq as ne
    out = _program_from_args(args)
    return ne.superoptimize(out, target=args.target, top_k=args.top_k, cache=not args.no_cache,
                            extra_rules=args.rules or (), progress=True)


def _optimize(args) -> int:
    kern = _superoptimize(args)
    print(f"== superoptimized in {kern.build_seconds:.2f} s (cache: {kern.cache_status}; "
          f"target {kern.target}; launches: {', '.join(kern.launches)})\n")
    print("== rewrite trace")
    print(kern.trace, "\n")
    print("== candidates")
    print(kern.candidate_table(), "\n")
    print("== chosen program")
    print(kern.program, "\n")
    print(f"== Triton source ({kern.config})")
    print(kern.source)
    if args.svg:
        from pathlib import Path
        Path(args.svg).write_text(kern.egraph_svg())
        print(f"== e-graph written to {args.svg}")
    return 0


def _explain(args) -> int:
    print(_superoptimize(args).explain())
    return 0


def _bench(args) -> int:
    import torch
    from triton.testing import do_bench
    if not torch.cuda.is_available():
        print("error: `neptune-eq bench` times kernels on a GPU and none is visible here; run "
              "`neptune-eq optimize` for the cost model's choice, or bench/neptune_ops.py on a "
              "GPU machine.", file=sys.stderr)
        return 2
    kern = _superoptimize(args)
    prog = kern.input_program
    ins = [torch.randn(ph.shape, device="cuda").to(getattr(torch, ph.dtype)) for ph in prog.inputs]
    ms = do_bench(lambda: kern(*ins), warmup=25, rep=200, return_mode="median")
    print(kern.candidate_table())
    print(f"chosen kernel: {ms * 1e3:.1f} us per call ({kern.config})")
    return 0


def _rules(args) -> int:
    from neptune_eq import rules
    if args.action == "list":
        for r in rules.listing(args.files or None):
            print(f"{r.name:<26} {r.where:<26} {r.comment}")
        return 0
    files = args.files or [str(f) for f in rules.shipped_rule_files()]
    bad = 0
    for f in files:
        try:
            results = rules.check(f)
        except rules.RuleFileError as e:
            print(f"REJECTED {e}")
            bad += 1
            continue
        for r in results:
            print(f"{r.status:<10} {r.name:<26} {r.where:<26} {r.method}"
                  + (f"\n           {r.detail}" if r.status == "UNSOUND" else ""))
            bad += r.status == "UNSOUND"
    print(f"{bad} unsound rule(s)" if bad else "all rules sound (proved, tested, or checked per firing)")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; errors are one or two lines on stderr and exit code 2
    (``--debug`` shows the traceback instead)."""
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one place that turns errors into text
        if args.debug:
            raise
        print(_error_text(e), file=sys.stderr)
        return 2


def _error_text(e: Exception) -> str:
    """An error as at most two lines.  neptune_eq's own errors already say expected / got /
    what to try; anything else is a bug in neptune_eq, and says how to see more."""
    from neptune_eq.errors import (ProgramError, RuleFileError, TranslationValidationError)
    from neptune_eq.lowering.lower import LoweringError
    ours = (ProgramError, RuleFileError, TranslationValidationError, LoweringError, ValueError,
            TypeError, RuntimeError, FileNotFoundError)
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, ours):
        return f"error: {text}"
    return (f"internal error ({type(e).__name__}): {text}\n"
            "run the same command with --debug for the traceback, and please report it")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of a short message")
    ap = argparse.ArgumentParser(prog="neptune-eq", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[common],
                       help="superoptimize a small plain attention (or softmax) and "
                            "print the trace, the chosen program and the Triton source")
    d.add_argument("--op", choices=["attention", "softmax"], default="attention")
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--heads", type=int, default=2)
    d.add_argument("--seq-q", type=int, default=40)
    d.add_argument("--seq-kv", type=int, default=72)
    d.add_argument("--head-dim", type=int, default=32)
    d.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    d.add_argument("--target", default="auto", choices=["auto", "cuda", "interpreter"])
    d.set_defaults(fn=_demo)
    for name, fn, text in (("optimize", _optimize, "superoptimize a program and print its trace, "
                                                   "candidates and Triton source"),
                           ("explain", _explain, "print the derivation of the chosen kernel"),
                           ("bench", _bench, "superoptimize and time the kernel on the GPU")):
        o = sub.add_parser(name, help=text, parents=[common])
        o.add_argument("--file", help="a Python file defining program() (default: attention from flags)")
        o.add_argument("--batch", type=int, default=1)
        o.add_argument("--heads", type=int, default=2)
        o.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer KV heads")
        o.add_argument("--seq-q", type=int, default=16)
        o.add_argument("--seq-kv", type=int, default=48)
        o.add_argument("--head-dim", type=int, default=32)
        o.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
        o.add_argument("--causal", action="store_true")
        o.add_argument("--softcap", type=float, default=0.0)
        o.add_argument("--window", type=int, default=0)
        o.add_argument("--target", default="auto", choices=["auto", "cuda", "interpreter"])
        o.add_argument("--top-k", type=int, default=3, help="candidates timed on the GPU")
        o.add_argument("--no-cache", action="store_true")
        o.add_argument("--rules", nargs="*", help="extra rule files")
        o.add_argument("--svg", help="write the saturated e-graph as SVG to this path")
        o.set_defaults(fn=fn)
    r = sub.add_parser("rules", parents=[common],
                       help="list the rules, or check rule files for soundness")
    r.add_argument("action", choices=["list", "check"])
    r.add_argument("files", nargs="*", help="rule files (default: the shipped ones)")
    r.set_defaults(fn=_rules)
    return ap


if __name__ == "__main__":
    sys.exit(main())
