"""A kernel call at a signature met before, replayed with only the data left to bind.

At decode lengths and in sparse or short training steps the GPU finishes a kernel before
the host has issued the next call, so host time per call is the speed.  The general call
(``Launcher.__call__``) binds ~30 arguments by name, reads every stride, looks up the
pre-pass plan, allocates the summaries and works out Triton's specialisation key, on
every call.  All of that is a function of the inputs' *signature* -- shape, stride,
dtype and device of each tensor -- except the data pointers.  ``BoundCall`` does the
work once per signature: a call then allocates its outputs (and summaries / split-k
scratch), lists the arguments by position, checks each pointer's 16-byte alignment and
launches the compiled kernels Triton chose under that key (``launch.FastLaunch``).

Anything it was not made for -- a first call under a new launch key, a pointer that
breaks a TMA config's alignment, the interpreter -- goes to the launcher's own path, so
a replay never launches something the general call would not.  ``arg_lists`` is the
replay's argument assembly, tested equal to ``Launcher._arg_lists`` on every kernel form
(pre-pass, split-k in one and two launches).
"""
from __future__ import annotations

import itertools
import threading

from .descriptors import ensure_allocator, tma_ok
from .index_check import check_data_indices
from .launch import OutputMaker, host_queries, written_outputs


class BoundCall:
    """The launches of one launcher at one input signature.

    ``names``: the kernel's inputs in call order; ``tensors``: an example call (inputs
    and outputs by name) of that signature, used for shapes and strides only."""

    def __init__(self, launcher, names: list[str], tensors: dict, outputs: list[str]):
        import torch
        if getattr(launcher, "gluon", False):
            raise ValueError("The Gluon form is replayed by gluon_launch.GluonBoundCall.")
        if launcher.tma and not tma_ok(launcher.ks.descriptors, tensors):
            launcher = launcher._pointer_form(tensors)  # strides TMA cannot take: fixed here
        la = self.launcher = launcher
        ks = la.ks
        self.names, self.outputs = list(names), list(outputs)
        self.device = tensors[self.names[0]].device
        self.interpret = la.target == "interpreter"
        self.out_specs = [(tuple(tensors[n].shape), tensors[n].dtype) for n in self.outputs]
        self.make_outputs = OutputMaker(self.out_specs, self.device)
        self.zeroed = [k for k, n in enumerate(self.outputs) if n in ks.scattered]
        slot = {n: k for k, n in enumerate(self.names + self.outputs)}
        # the pre-pass: its plan for these captured shapes, and where its inputs sit
        self.pre = None
        if la._pre is not None:
            pre = la._pre
            xs, (outs, tail, launch) = pre.plan_for(tensors)
            tensors = dict(tensors)
            for name, shape, dtype in outs:  # their strides are read below
                slot[name] = len(slot)
                tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
            self.pre = ([slot[t] for t, _ in pre.pre.tensors], outs, launch,
                        [v for x in xs for v in (*x.shape, *x.stride())] + tail)
        elif ks.summaries:
            raise ValueError("a kernel whose summaries are built by torch is not replayed")
        self.param_slots = [slot[n[:-4]] for n in ks.params]
        st = {t: tensors[t].stride() for t in la.stride_of}
        self.strides = [st[t][k] for t, k in ks.stride_params] + list(la.size_args)
        ints = self.strides + self.pre[3] if self.pre else self.strides
        self.int_key = None
        if la.fast_ok:
            self.int_key = la._int_class(ints) if la._int_class else tuple(ints)
        # split-k: one scratch buffer per call, cut into the fold states (16-byte aligned)
        self.scratch = None
        if ks.split_extent:
            chunk, nsplit = la._chunks
            rows = nsplit * ks.grid_size * ks.row_extent
            sizes = [rows * w for w in ks.scratch.values()]
            pad = [-(-n // 4) * 4 for n in sizes]
            self.scratch = (sum(pad), list(zip(sizes, itertools.accumulate([0] + pad))),
                            chunk, nsplit)
        self.steps = ([self.pre[2]] if self.pre else []) + la._launches
        # each launch's arguments end in integers fixed by the signature (strides, sizes,
        # chunking): kept here, after the call's own (pointers) -- ``_leading``
        if self.pre:
            self.tails = [self.pre[3]]
        else:
            self.tails = []
        if self.scratch is None:
            self.tails.append(self.strides)
        elif la.config.fused:
            self.tails.append(self.strides + [self.scratch[2], self.scratch[3]])
        else:
            self.tails += [self.strides + [self.scratch[2]], self.strides + [self.scratch[3]]]
        self.host = None if self.interpret else host_queries()
        self._plans: dict = {}  # stream -> (checked kernels, prepared calls)
        self.desc_slots = ([slot[n] for n in ks.descriptors] if la.tma else [])
        self._fp32 = torch.float32
        # (stream, thread) -> the split-k fold states' scratch, kept between calls: calls
        # on one stream run in order, so the next call's partials are written after this
        # one's combine has read them.  Allocating and cutting it per call took 13-24 us
        # of a warm decode call's 46-89 us of host time (H200 host,
        # bench/decode_host_ab.py).  Per thread too: two threads sharing a stream could
        # interleave their launches, one call's partials written between another's.
        self._scratch: dict = {}
        # ... and the pre-pass's summaries, the same way: each call's pre-pass rewrites
        # them before its kernel reads them, in stream order
        self._summaries: dict = {}

    def arg_lists(self, vals: list, stream, capturing: bool | None = None,
                  pointers: bool = False) -> list[list]:
        """The arguments of every launch, in order, for the call whose tensors are
        ``vals`` (inputs, outputs, then summaries, as ``slots`` number them); ``capturing``
        (a CUDA graph capture is running) as the caller found it, else asked here.
        ``pointers``: ``vals`` are the tensors' data pointers (ints), and the scratch and
        semaphores go in as theirs too (see ``__call__``)."""
        return [lead + tail for lead, tail in
                zip(self._leading(vals, stream, capturing, pointers), self.tails)]

    def _leading(self, vals: list, stream, capturing: bool | None, pointers: bool) -> list:
        """Each launch's arguments before its ``tails``: what changes from call to call
        (pointers, the kept scratch; ``arg_lists`` says the rest).  Two launches may
        share one list."""
        args = [vals[k] for k in self.param_slots]
        lists = []
        if self.pre:
            lists.append([vals[k] for k in self.pre[0]] + vals[len(vals) - len(self.pre[1]):])
        if self.scratch is None:
            lists.append(args)
            return lists
        total, cuts = self.scratch[:2]
        # A call captured in a CUDA graph takes a fresh buffer from the graph's own pool,
        # which the graph keeps alive for its replays; a kept one could be freed first.
        if capturing is None:
            capturing = stream is not None and self.host.capturing()

        def scratch():  # the fold states' slices, and their data pointers
            buf = written_outputs([((total,), self._fp32)], self.device)[0]
            cut = [buf[at:at + n] for n, at in cuts]
            return cut, [c.data_ptr() for c in cut]
        # while a graph is captured the buffer is fresh and only its tensors hold it:
        # those go to the launch, not their pointers, so it stays alive past the launch
        ws = _kept(self._scratch, _FRESH if capturing else stream, scratch)[
            1 if pointers and not capturing else 0]
        if self.launcher.config.fused:
            sem = self.launcher._semaphores(self.device, stream)
            sem = sem.data_ptr() if pointers else sem
            lists.append(args + ws + [sem])
        else:
            lead = args + ws
            lists += [lead, lead]
        return lists

    def _launch_plan(self, cks: list, stream):
        """Each launch's ``FastLaunch.prepared`` call for the checked kernels ``cks`` on
        ``stream``, kept per stream (and remade when the key's kernels are not those it
        was made for); None where a launch has no raw launcher."""
        got = self._plans.get(stream)
        if got is not None and got[0] is cks:
            return got[1]
        plan = [fl.prepared(ck, stream, tail) for fl, ck, tail in zip(self.steps, cks, self.tails)]
        plan = None if any(p is None for p in plan) else plan
        self._plans[stream] = (cks, plan)
        return plan

    def _summary_buffers(self, stream, capturing: bool) -> list:
        """The pre-pass's outputs for this call: kept per (stream, thread) on the GPU;
        fresh in the interpreter and while a CUDA graph is captured (the graph's pool
        keeps those alive for its replays)."""
        return _kept(self._summaries, _FRESH if self.interpret or capturing else stream,
                     lambda: written_outputs([(shape, dt) for _, shape, dt in self.pre[1]],
                                             self.device))

    def __call__(self, inputs: list) -> list:
        """Launch on ``inputs`` (tensors of this signature, in call order); the outputs."""
        outs = self.make_outputs()
        for k in self.zeroed:  # atomically summed outputs start at zero
            outs[k].zero_()
        vals = inputs + outs
        la = self.launcher
        if self.interpret:
            check_data_indices(la.program, dict(zip(self.names, inputs)))
            if self.pre:
                vals += self._summary_buffers(None, False)
            for fl, a in zip(self.steps, self.arg_lists(vals, None)):
                fl.fn[fl.grid](*a, **fl.consts, **fl.options)
            return outs
        # the device, stream and capture state, asked once per call (kept buffers and
        # launches both need them; only kept buffers need the capture state)
        host = self.host
        cur = host.device()
        stream = host.stream(cur)
        capturing = bool(self.pre or self.scratch) and host.capturing()
        if self.pre:
            vals += self._summary_buffers(stream, capturing)
        cks = None
        ptrs = [t.data_ptr() for t in vals]
        tma_pointers_ok = not any(ptrs[k] & 15 for k in self.desc_slots)
        if self.int_key is not None and la.fast_ok and tma_pointers_ok:
            align = tuple([ptrs[k] & 15 == 0 for k in self.param_slots])
            cks = la._checked.get((cur, align, self.int_key))
        if cks is None:  # not checked under this key yet, or TMA cannot take these pointers
            la({**dict(zip(self.names, inputs)), **dict(zip(self.outputs, outs))})
            return outs
        if la.tma:  # descriptors are encoded from the tensors themselves
            ensure_allocator()  # per call: Triton keeps the allocator per thread context
            lists = self.arg_lists(vals, stream, capturing)
        else:
            # Pointers go to the launcher as ints: Triton's launcher takes an int as the
            # address itself, where for a tensor it calls data_ptr() and asks the driver
            # (cuPointerGetAttribute) whether the GPU can reach it -- per pointer, per
            # launch.  The signature this replay is keyed on fixed every tensor's device
            # (a CUDA device, checked by the general call), so the answer is known here.
            leads = self._leading(ptrs, stream, capturing, pointers=True)
            plan = None if host.hooks_set() else self._launch_plan(cks, stream)
            if plan is not None:  # no profiler hook: one call per launch
                for (raw, head, tail), lead in zip(plan, leads):
                    raw(*head, *lead, *tail)
                return outs
            lists = [lead + tail for lead, tail in zip(leads, self.tails)]
        for fl, ck, a in zip(self.steps, cks, lists):
            fl.fast(ck, a, stream)
        return outs


_FRESH = object()  # ``_kept``'s stream for a call whose buffers are not kept


def _kept(store: dict, stream, make):
    """``make()``'s buffers kept in ``store`` per (stream, thread) between calls -- each
    call rewrites them before its kernels read them, in its stream's order -- or, with
    ``stream`` ``_FRESH`` (a CUDA graph capture: the graph's pool keeps them for its
    replays), fresh and not kept."""
    if stream is _FRESH:
        return make()
    key = (stream, threading.get_ident())
    got = store.get(key)
    if got is None:
        got = store[key] = make()
    return got
