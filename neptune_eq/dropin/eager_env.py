"""Eager ``ne.flex_attention`` calls: trace the mods once per environment, not per call.

Tracing the mods costs milliseconds, so the structure of a call is remembered per
*environment* of its mods (``eager_structure``): their code objects and, along every path
``torch_op._Walk`` finds (closure cells, globals the code names, defaults, partial
arguments, ``self`` attributes), each scalar's value and each tensor's shape, dtype and
device.  Walking that graph is itself ~15 us of host time per call -- a fifth of a call
at decode lengths -- so mods whose environment is *flat* (a plain function whose cells,
named globals and defaults are all tensors, scalars or library objects: ``doc[q] ==
doc[kv]``, a softcap constant, an ALiBi slope table) get a shallow re-check instead
(``_Flat``): the same leaves, read in place, compared with what the walk saw.  Anything
deeper takes the full walk, so the shallow check only ever skips work, never a guard.
"""
from __future__ import annotations

import collections
import types
import weakref

from torch import Tensor

from . import flex
from ..frontend.torch_capture import made_from_data
from .torch_op import _SCALARS, _Walk, _fetch, _is_library, _library_module, _names

_EAGER_PLANS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_EAGER_PLANS_MAX = 256   # mod environments remembered (least recently used goes first)
# (id(score_mod), id(mask_mod)) -> (_Flat per mod, spec, sizes or None, key, fetch plan)
_FLAT_HITS: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def forget() -> None:
    """Forget every structure, the eager calls' remembered environments and the backward
    plans, as a new process would start (the kernel cache on disk stays): the next call
    traces, builds and plans anew.  Benches call it between settings of a lowering
    switch -- a structure key does not name the switches, so a structure, an environment
    hit or a backward plan kept from before would run the other setting's kernels."""
    from . import backward_plan
    flex.STRUCTURES.clear()
    _EAGER_PLANS.clear()
    _FLAT_HITS.clear()
    backward_plan.clear()


def eager_structure(score_mod, mask_mod, spec: "flex.Spec", sizes: dict[str, int]
                    ) -> tuple[str, list]:
    """The structure key and captured tensors of an eager call.  A call whose environment
    fingerprint matches one seen before reuses its structure and fetches the captured
    tensors along the remembered paths (a new tensor in the same place is used); anything
    else -- a changed closure constant, a swapped nested function, a reshaped table, an
    object ``_Walk`` cannot see through -- traces again."""
    roots = (score_mod, mask_mod)
    flat = _FLAT_HITS.get((id(score_mod), id(mask_mod)))
    if flat is not None and (flat[1] is spec or flat[1] == spec) and (
            flat[2] is None or flat[2] == sizes) and all(
                f.holds(m) for f, m in zip(flat[0], roots)):
        return flat[3], _captured(roots, flat[4])
    walks = [_Walk(m, codes=True) for m in roots]
    if any(w.opaque for w in walks):
        st, tensors = flex.trace(spec, score_mod, mask_mod, sizes)
        return st.key, list(tensors.values())
    fp = (spec, tuple(type(m) for m in roots),
          tuple((r, p, c) for r, w in enumerate(walks) for p, c in w.codes),
          tuple((r, p, type(x), x) for r, w in enumerate(walks) for p, x in w.scalars),
          tuple((r, p, tuple(x.shape), x.dtype, x.device) for r, w in enumerate(walks)
                for p, x in w.tensors))
    hit = _EAGER_PLANS.get(fp)
    if hit is not None and (hit[2] is None or hit[2] == sizes):
        _EAGER_PLANS.move_to_end(fp)
    else:
        st, tensors = flex.trace(spec, score_mod, mask_mod, sizes)
        where = {id(x): (r, p) for r, w in enumerate(walks) for p, x in w.tensors}
        if any(made_from_data(x) for x in tensors.values()):
            # A tensor the mods computed while traced from existing ones ((doc > 0)[q_idx])
            # is this call's data, and no path fetches it again: remembered, a later call
            # would read the first call's values.  Such mods are traced on every call.
            return st.key, list(tensors.values())
        plan = tuple(("path",) + where[id(x)] if id(x) in where else ("const", x)
                     for x in tensors.values())
        # A structure traced at this call's sizes (a table longer than S) holds only for them.
        hit = _EAGER_PLANS[fp] = (st.key, plan, None if st.symbols else dict(sizes))
        if len(_EAGER_PLANS) > _EAGER_PLANS_MAX:
            _EAGER_PLANS.popitem(last=False)
    flats = [_Flat.of(m) for m in roots]
    if all(f is not None for f in flats):
        _FLAT_HITS[(id(score_mod), id(mask_mod))] = (flats, spec, hit[2], hit[0], hit[1])
        if len(_FLAT_HITS) > _EAGER_PLANS_MAX:
            _FLAT_HITS.popitem(last=False)
    return hit[0], _captured(roots, hit[1])


def _captured(roots: tuple, plan: tuple) -> list:
    """The captured tensors of this call: fetched along each remembered path (a new
    tensor in the same place is used), or the constant the trace made (a literal of the
    mod's code, ``torch.tensor([...])[h]``: one made from data is traced per call)."""
    return [_fetch(roots[c[1]], c[2]) if c[0] == "path" else c[1] for c in plan]


_MISSING = object()


class _Flat:
    """The environment of a mod that ``_Walk`` sees as leaves only, read in place.

    For a plain function: its code, and each closure cell, each global its code names
    and each default, as what the walk would record there -- a tensor's (shape, dtype,
    device), a scalar's (type, value), a library object's identity (the walk skips it),
    or absent.  ``holds(fn)`` is true exactly when a full walk of ``fn`` would give the
    same fingerprint (the fields of a function object are only reassigned, never
    mutated, so comparing them by identity and their leaves by value is complete).
    The function is held weakly: a freed mod whose id is reused fails the check."""

    __slots__ = ("ref", "code", "defaults", "kwdefaults", "cells", "names", "leaves")

    @classmethod
    def of(cls, mod) -> "_Flat | None":
        if mod is None:
            return _NONE
        if type(mod) is not types.FunctionType or _library_module(mod):
            return None  # methods, partials, callable objects, and_masks: the full walk
        self = cls()
        self.ref = weakref.ref(mod)
        self.code, self.defaults = mod.__code__, mod.__defaults__
        self.kwdefaults = mod.__kwdefaults__
        self.cells = mod.__closure__ or ()
        self.names = sorted(_names(mod.__code__))
        self.leaves = self._read(mod)
        return None if any(leaf is None for leaf in self.leaves) else self

    def _read(self, fn) -> list:
        out = []
        for cell in self.cells:
            try:
                out.append(_leaf(cell.cell_contents))
            except ValueError:  # an empty cell: nothing to read yet
                out.append(("empty",))
        g = fn.__globals__
        out += [_leaf(g.get(n, _MISSING)) for n in self.names]
        out += [_leaf(a) for a in self.defaults or ()]
        out += [_leaf(a) for a in (self.kwdefaults or {}).values()]
        return out

    def holds(self, fn) -> bool:
        if self is _NONE:
            return fn is None
        if not (self.ref() is fn and fn.__code__ is self.code and fn.__defaults__ is self.defaults
                and fn.__kwdefaults__ is self.kwdefaults):
            return False
        now = self._read(fn)
        return len(now) == len(self.leaves) and all(
            a is not None and a[0] == b[0] and (a[1] is b[1] if a[0] == "library" else a == b)
            for a, b in zip(now, self.leaves))


_NONE = _Flat()  # the flat environment of an absent mod


def _leaf(x) -> tuple | None:
    """What the walk records for a leaf value; None for anything it would walk into."""
    if x is _MISSING:
        return ("missing",)
    if isinstance(x, Tensor):
        return ("tensor", type(x), tuple(x.shape), x.dtype, x.device)
    if isinstance(x, _SCALARS):
        if isinstance(x, float) and x != x:
            return None  # NaN: the walk leaves it out of the fingerprint; walk every time
        return ("scalar", type(x), x)
    if _is_library(x):
        return ("library", x)  # compared by identity
    return None
