"""Where the host's time in one eager training step goes, ours next to FlexAttention's.

    python bench/step_host.py --out DIR [--S 2048] [--variants 'plain,causal,window(256),doc(13)']

At S = 2048 a fwd+bwd of attention (bf16, B=2, H=16, D=128) takes 0.2-0.6 ms of GPU time,
so an eager step runs at the host's pace.  This times host segments alone -- the GPU idle
before each one (synchronised), so a launch never waits for queue space -- as the median
of many repetitions, in microseconds:

* ``step``       -- fwd+bwd in a loop without synchronising (the pace of a training loop);
* ``fwd`` / ``bwd`` -- the forward call that records the autograd graph, and
  ``torch.autograd.grad`` over it;
* for ours, pieces of those: the forward without autograd, ``flex_backward.run_backward``
  called directly (the backward less the autograd engine), and each backward kernel's
  call alone (``Kernel.__call__`` on tensors already prepared).

One JSON per line in ``DIR/step_host.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from backward_gpu import B, D, H, step_tensors  # noqa: E402
from backward_streams_probe import backward_args  # noqa: E402
from host_profile import loop_us  # noqa: E402
from neptune_eq.dropin import flex, flex_backward  # noqa: E402


def host_us(fn, reps: int = 200) -> float:
    """Median host microseconds of ``fn()``, the GPU idle before each call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def grad_times(fwd, q, k, v, g, reps: int) -> list[float]:
    """Seconds of ``torch.autograd.grad`` over ``fwd(q, k, v)``, each after the forward
    ran and the GPU was synchronised."""
    times = []
    for _ in range(reps):
        out = fwd(q, k, v)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), g)
        times.append(time.perf_counter() - t0)
    return times


def segments(fn, q, k, v, g, prefix: str) -> dict:
    row = {}
    row[f"{prefix}step"] = loop_us(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), g))
    row[f"{prefix}fwd"] = host_us(lambda: fn(q, k, v))
    row[f"{prefix}bwd"] = statistics.median(grad_times(fn, q, k, v, g, 200)[5:]) * 1e6
    return row


def ours_pieces(kw, q, k, v, g) -> dict:
    row = {}
    with torch.no_grad():
        row["ours_fwd_nograd"] = host_us(lambda: ne.flex_attention(q, k, v, **kw))
    args = backward_args(kw, q, k, v, g)
    row["ours_run_backward"] = host_us(lambda: flex_backward.run_backward(*args))
    skey, q_, k_, v_, captured, out, lse, d_out, d_lse, needs = args
    st = flex.STRUCTURES[skey]
    row["ours_backward_env"] = host_us(lambda: flex_backward.backward_env(
        st, q_, k_, v_, captured, out, lse, d_out, d_lse))
    names, _, sizes, env = flex_backward.backward_env(st, q_, k_, v_, captured, out, lse,
                                                      d_out, d_lse)
    groups = flex_backward.chosen_groups(st, names, needs, sizes, d_lse is not None, env)
    row["ours_form"] = "+".join("".join(gr) for gr in groups)
    for group, built in flex_backward.group_kernels(st, groups, sizes, d_lse is not None, env):
        bw, kern, _, _, stats, pre = built
        if pre is not None:
            first, rows = pre
            a = [env[ph.name] for ph in first.program.inputs]
            row["ours_kernel_rows"] = host_us(lambda: rows(*a))
            res = rows(*a)
            env.update(zip(stats, res if isinstance(res, tuple) else (res,)))
        a = [env[ph.name] for ph in bw.program.inputs]
        row[f"ours_kernel_{''.join(group)}"] = host_us(lambda: kern(*a))
    x = torch.randn(B, H, q.shape[2], D, device="cuda")
    row["torch_to_bf16"] = host_us(lambda: x.to(torch.bfloat16))
    row["torch_empty"] = host_us(lambda: torch.empty_like(x))
    return row


def engine_split(kw, q, k, v, g, reps: int = 200) -> dict:
    """Host microseconds of ``torch.autograd.grad`` over our step, split into the time
    inside our Function's backward, inside ``run_backward``, and the rest (the autograd
    engine: its thread hand-off, graph walk, checks)."""
    from neptune_eq.dropin import torch_op
    spent = {"fn": [], "run": []}
    real_fn, real_run = torch_op.EagerFlexAttention.backward, flex_backward.run_backward

    def timed_fn(ctx, *a):
        t0 = time.perf_counter()
        try:
            return real_fn(ctx, *a)
        finally:
            spent["fn"].append(time.perf_counter() - t0)

    def timed_run(*a):
        t0 = time.perf_counter()
        try:
            return real_run(*a)
        finally:
            spent["run"].append(time.perf_counter() - t0)
    torch_op.EagerFlexAttention.backward = staticmethod(timed_fn)
    flex_backward.run_backward = timed_run
    try:
        total = grad_times(lambda q, k, v: ne.flex_attention(q, k, v, **kw), q, k, v, g, reps)
    finally:
        torch_op.EagerFlexAttention.backward = staticmethod(real_fn)
        flex_backward.run_backward = real_run
    med = {k: statistics.median(x[5:]) * 1e6 for k, x in (("grad", total), *spent.items())}
    return {"split_grad": med["grad"], "split_function_backward": med["fn"],
            "split_run_backward": med["run"]}


def _profiled(fn, calls: int) -> str:
    """cProfile of ``calls`` calls of ``fn`` (20 warm-up calls first), by own time."""
    import cProfile
    import io
    import pstats
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    return buf.getvalue()


def engine_profile(kw, q, k, v, g, reps: int = 200) -> tuple[dict, str]:
    """Our backward inside ``torch.autograd.grad`` against the same work called directly:
    host us of the grad, of our Function's backward inside it (the engine's device
    thread), of ``run_backward`` called from this thread and from another Python thread;
    and the cProfile of the Function's backward in the engine's thread (by own time)."""
    import cProfile
    import io
    import pstats
    import threading
    from neptune_eq.dropin import torch_op
    real_fn = torch_op.EagerFlexAttention.backward
    pr, spent, where, seen = cProfile.Profile(), {False: [], True: []}, set(), {}

    def grads(wrapped, n):
        torch_op.EagerFlexAttention.backward = staticmethod(wrapped)
        try:
            return statistics.median(grad_times(
                lambda q, k, v: ne.flex_attention(q, k, v, **kw), q, k, v, g, n)) * 1e6
        finally:
            torch_op.EagerFlexAttention.backward = staticmethod(real_fn)

    def timed(profile):
        def fn(ctx, *a):
            if not where:  # what the engine passes, beside what the direct call gets
                seen.update(grads_in=[None if x is None else (tuple(x.shape), x.stride(), str(x.dtype))
                                      for x in a], needs=list(ctx.needs_input_grad))
            where.add(threading.get_ident())
            t0 = time.perf_counter()
            if profile:
                pr.enable()
            try:
                return real_fn(ctx, *a)
            finally:
                if profile:
                    pr.disable()
                spent[profile].append(time.perf_counter() - t0)
        return fn
    grads(real_fn, 10)  # builds and first calls outside every measurement
    total = grads(timed(False), reps)
    grads(timed(True), reps)
    args = backward_args(kw, q, k, v, g)
    here = host_us(lambda: flex_backward.run_backward(*args))
    other = {}
    th = threading.Thread(target=lambda: other.update(
        us=host_us(lambda: flex_backward.run_backward(*args))))
    th.start()
    th.join()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    row = {"engine_grad": total,
           "engine_function_backward": statistics.median(spent[False]) * 1e6,
           "engine_function_backward_profiled": statistics.median(spent[True]) * 1e6,
           "run_backward_main_thread": here, "run_backward_other_thread": other.get("us"),
           "engine_thread_is_main": threading.get_ident() in where, **seen,
           "direct_args": [(tuple(x.shape), x.stride(), str(x.dtype)) if hasattr(x, "shape")
                           else repr(x)[:40] for x in args[1:]]}
    return row, buf.getvalue()


def run_backward_profile(kw, q, k, v, g, calls: int = 300) -> str:
    """cProfile of ``flex_backward.run_backward`` called directly (our backward's host work
    less the autograd engine)."""
    args = backward_args(kw, q, k, v, g)
    return _profiled(lambda: flex_backward.run_backward(*args), calls)


def call_profile(kw, q, k, v, g, calls: int = 500) -> str:
    """cProfile of ``calls`` direct calls of each backward kernel this step runs (own
    time), on the row statistics its pre-pass made, as ``run_backward`` calls them."""
    args = backward_args(kw, q, k, v, g)
    skey, q_, k_, v_, captured, out, lse, d_out, d_lse, needs = args
    st = flex.STRUCTURES[skey]
    names, _, sizes, env = flex_backward.backward_env(st, q_, k_, v_, captured, out, lse,
                                                      d_out, d_lse)
    groups = flex_backward.chosen_groups(st, names, needs, sizes, d_lse is not None, env)
    parts = []
    for group, built in flex_backward.group_kernels(st, groups, sizes, d_lse is not None, env):
        bw, kern, _, _, stats, pre = built
        if pre is not None:
            first, rows = pre
            res = rows(*[env[ph.name] for ph in first.program.inputs])
            env.update(zip(stats, res if isinstance(res, tuple) else (res,)))
        a = [env[ph.name] for ph in bw.program.inputs]
        parts.append(f"== kernel {''.join(group)} ==\n" + _profiled(lambda: kern(*a), calls))
    return "\n".join(parts)


def backward_trace(kw, q, k, v, g, steps: int = 30) -> str:
    """torch.profiler's CPU ops (every thread: the autograd engine runs a CUDA backward on
    its device thread, where cProfile in this one cannot see) of ``steps`` backward calls of
    ours, the forward outside the trace: what the engine does around our Function."""
    from torch.profiler import ProfilerActivity, profile, record_function
    outs = []
    for _ in range(steps + 5):
        outs.append(ne.flex_attention(q, k, v, **kw))
    for o in outs[:5]:
        torch.autograd.grad(o, (q, k, v), g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for o in outs[5:]:
            with record_function("grad_call"):
                torch.autograd.grad(o, (q, k, v), g)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)


def _gluon_launchers() -> list:
    """Every ``GluonLauncher`` alive in this process (``type``, not ``isinstance``: the
    heap holds weak proxies of dead objects, which ``isinstance`` would dereference)."""
    import gc
    from neptune_eq.runtime.gluon_launch import GluonLauncher
    return [o for o in gc.get_objects() if type(o) is GluonLauncher]


def gluon_launches() -> dict:
    """Per Gluon launcher this process made: whether its fast launch is on, and how many
    of its checked kernels launch with encoded descriptors (``runtime/tma_launch.py``)
    and how many maps they keep -- the evidence that a host-time A/B ran that path."""
    from neptune_eq.runtime.launch import _hook_source
    src, enter, exit_ = _hook_source()
    out = {"hooks": f"{getattr(src, enter)!r} / {getattr(src, exit_)!r}"}
    for la in _gluon_launchers():
        encs = [e for _, e in la._encoded.values()]
        out[f"{la.form.name}@{id(la):x}"] = (
            f"fast {la.fast_ok} {la.fast_reason}; encoded {sum(e is not None for e in encs)}"
            f"/{len(encs)} kernels, {sum(len(e.maps) for e in encs if e is not None)} maps")
    return out


def encoded_ab(kw, q, k, v, g, rounds: int = 6) -> dict:
    """Host microseconds of session 31's launch changes, alternated ``rounds`` times in this
    process (separate processes on the lent machine moved the same segment by up to 2x):
    ``before`` -- Triton 3.6's always-present hook chains passed to every launch, with its
    metadata made, ``CompiledKernel.run`` called and descriptors encoded per call;
    ``raw`` -- empty chains passed as None and the compiled launcher called directly
    (``runtime.launch.raw_launcher``); ``all`` -- and the Gluon kernels' descriptors
    encoded once per address (``runtime/tma_launch.py``).  Per mode: ``run_backward``
    called directly (synchronised before each call) and the eager fwd+bwd step in a loop
    without synchronising."""
    from host_profile import launch_settings
    args = backward_args(kw, q, k, v, g)

    def step():
        torch.autograd.grad(ne.flex_attention(q, k, v, **kw), (q, k, v), g)
    modes = {"before": (False, False, False), "raw": (True, True, False),
             "all": (True, True, True)}
    got = {f"ab_{m}_{w}": [] for m in modes for w in ("run_backward", "step")}
    restore = launch_settings()
    try:
        for _ in range(rounds):
            for mode, switches in modes.items():
                launch_settings(*switches)
                got[f"ab_{mode}_run_backward"].append(
                    round(host_us(lambda: flex_backward.run_backward(*args)), 1))
                got[f"ab_{mode}_step"].append(round(loop_us(step), 1))
    finally:
        restore()
    return got


def plan_ab(kw, q, k, v, g, flex_c, rounds: int = 6) -> dict:
    """Host microseconds with the backward's plans (``dropin/backward_plan``) off and on,
    and FlexAttention's compiled step, alternated ``rounds`` times in this process: the
    eager fwd+bwd step in a loop without synchronising, and ``autograd.grad`` alone (the
    forward before it synchronised); the gradients of both modes must be bit-identical."""
    from neptune_eq.dropin import backward_plan

    def bwd_us(fn, reps=100):
        return statistics.median(grad_times(fn, q, k, v, g, reps)[5:]) * 1e6
    ours = lambda q, k, v: ne.flex_attention(q, k, v, **kw)  # noqa: E731
    theirs = lambda q, k, v: flex_c(q, k, v, **kw)  # noqa: E731
    modes = {"plan_off": (ours, False), "plan_on": (ours, True), "flex": (theirs, True)}
    got = {f"ab_{m}_{w}": [] for m in modes for w in ("step", "bwd")}
    grads = {}
    try:
        for _ in range(rounds):
            for mode, (fn, on) in modes.items():
                backward_plan.ENABLED = on
                step = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), g)  # noqa: E731
                got[f"ab_{mode}_step"].append(round(loop_us(step), 1))
                got[f"ab_{mode}_bwd"].append(round(bwd_us(fn), 1))
                grads[mode] = step()
    finally:
        backward_plan.ENABLED = True
    got.update({f"median_{k[3:]}": statistics.median(x) for k, x in got.items()})
    got["plan_grads_bit_identical"] = all(
        torch.equal(a, b) for a, b in zip(grads["plan_off"], grads["plan_on"]))
    return got


def call_forms(kw, q, k, v, g) -> dict:
    """What a warm step runs: the forward kernel's config and how it is replayed (its
    replay's class, or none: the general call each time), and the backward's plan (each
    step's replay class and kernel config) or why it keeps the general path."""
    from neptune_eq.dropin import backward_plan, flex
    args = backward_args(kw, q, k, v, g)
    skey, q_, k_, v_, captured, out, lse, d_out, d_lse, needs = args
    kern = flex.STRUCTURES[skey].kernel
    fwd = kern.replay_for([q_, k_, v_, *captured])
    row = {"forward_config": str(kern.config), "forward_replay": type(fwd).__name__}
    if fwd is not None and hasattr(fwd, "launcher"):
        row["forward_launch_config"] = str(getattr(fwd.launcher, "config", ""))
    key = backward_plan.plan_key(skey, needs, [q_, k_, v_, *captured, out, lse, d_out], d_lse)
    plan = backward_plan.get(key)
    row["backward_plan"] = ("none kept" if key not in backward_plan._PLANS else
                            "general path (a kernel without a replay)" if plan is None else
                            [f"{type(st.call).__name__} {getattr(st.call.launcher, 'config', '')}"
                             f" -> {','.join(st.outputs)}" for st in plan.steps])
    return row


def engine_baseline(reps: int = 300) -> dict:
    """Host microseconds of ``torch.autograd.grad`` through one trivial Python
    ``autograd.Function`` on CUDA tensors (backward returns its cotangent), beside its
    forward alone: what the engine costs any Python-defined backward -- ours and
    FlexAttention's -- before its own work.  Then the same with a backward that spends
    ~200 us of Python, to see whether the engine's share grows with the work."""
    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    class Busy(Ident):
        @staticmethod
        def backward(ctx, g):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 2e-4:
                pass
            return g
    x = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.randn(1024, device="cuda")
    row = {}
    for name, fn in (("trivial", Ident), ("busy_200us", Busy)):
        row[f"engine_{name}_grad"] = host_us(lambda: torch.autograd.grad(fn.apply(x), x, g), reps)
        row[f"engine_{name}_forward"] = host_us(lambda: fn.apply(x), reps)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--variants", default="plain,causal,window(256),doc(13)")
    ap.add_argument("--rounds", type=int, default=1, help="measure each variant this often")
    ap.add_argument("--detail", action="store_true",
                    help="also split the backward's host time and profile one kernel call")
    ap.add_argument("--encoded-ab", action="store_true",
                    help="also this session's launch changes on/off, alternated in this process")
    ap.add_argument("--plan-ab", action="store_true",
                    help="only the backward plans off / on beside Flex, alternated")
    ap.add_argument("--engine-profile", action="store_true",
                    help="only our backward inside autograd.grad vs called directly, profiled")
    ap.add_argument("--engine-baseline", action="store_true",
                    help="also what the autograd engine costs a trivial Python backward")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.engine_baseline:
        row = {"variant": "engine_baseline", "device": torch.cuda.get_device_name(),
               **engine_baseline()}
        print(json.dumps({k: round(x, 1) if isinstance(x, float) else x for k, x in row.items()}),
              flush=True)
        with open(out / "step_host.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    S = a.S
    if a.engine_profile:
        for name in a.variants.split(","):
            kw, q, k, v, g = step_tensors(name, S)
            row, text = engine_profile(kw, q, k, v, g)
            row.update(variant=name, S=S, device=torch.cuda.get_device_name())
            (out / f"engine_profile_{name}.txt").write_text(text)
            (out / f"run_backward_profile_{name}.txt").write_text(
                run_backward_profile(kw, q, k, v, g, calls=200))
            print(json.dumps({k: round(x, 1) if isinstance(x, float) else x
                              for k, x in row.items()}), flush=True)
            with open(out / "step_host.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return
    flex_c = torch.compile(flex_attention)
    if a.plan_ab:
        for name in a.variants.split(","):
            kw, q, k, v, g = step_tensors(name, S)
            row = {"variant": name, "S": S, "device": torch.cuda.get_device_name(),
                   **plan_ab(kw, q, k, v, g, flex_c), **call_forms(kw, q, k, v, g)}
            print(json.dumps(row), flush=True)
            with open(out / "step_host.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return
    for name in a.variants.split(",") * a.rounds:
        row = {"variant": name, "S": S, "device": torch.cuda.get_device_name()}
        try:
            kw, q, k, v, g = step_tensors(name, S)
            row.update(segments(lambda q, k, v: ne.flex_attention(q, k, v, **kw), q, k, v, g,
                                "ours_"))
            row.update(segments(lambda q, k, v: flex_c(q, k, v, **kw), q, k, v, g, "flex_"))
            row.update(ours_pieces(kw, q, k, v, g))
            if a.encoded_ab:
                row.update(encoded_ab(kw, q, k, v, g))
            row["gluon_launches"] = gluon_launches()
            if a.detail:
                row.update(engine_split(kw, q, k, v, g))
                for what, fn in (("backward_trace", backward_trace),
                                 ("run_backward_profile", run_backward_profile),
                                 ("call_profile", call_profile)):
                    try:
                        text = fn(kw, q, k, v, g)
                    except Exception as e:  # noqa: BLE001 - the next detail still runs
                        text = f"failed: {type(e).__name__}: {e}"
                    (out / f"{what}_{name}.txt").write_text(text)
        except Exception as e:  # noqa: BLE001 - recorded, the next row runs
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps({k: round(x, 1) if isinstance(x, float) else x
                          for k, x in row.items()}), flush=True)
        with open(out / "step_host.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
