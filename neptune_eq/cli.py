"""``neptune-eq`` command line: ``demo`` superoptimizes plain attention and shows why."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    import torch

    import neptune_eq as ne
    from neptune_eq import examples
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
    ap = argparse.ArgumentParser(prog="neptune-eq", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="superoptimize a small plain attention (or softmax) and "
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
    r = sub.add_parser("rules", help="list the rules, or check rule files for soundness")
    r.add_argument("action", choices=["list", "check"])
    r.add_argument("files", nargs="*", help="rule files (default: the shipped ones)")
    r.set_defaults(fn=_rules)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
