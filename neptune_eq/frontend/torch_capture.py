"""Torch tensors a FlexAttention mod closes over, as kernel inputs.

Torch 2.x consults ``__torch_function__`` on the *elements of an index* in
``Tensor.__getitem__`` (verified on torch 2.13: ``t[e]``, ``t[0, e]`` and ``t[e, e]`` all
reach it with ``func = Tensor.__getitem__``), so ``bias[h, q_idx]`` in a mod arrives at
``torch_mods.dispatch`` as ``Tensor.__getitem__(bias, (h, q_idx))``.  Here it becomes a
load of a placeholder made for ``bias``: one per tensor object, in first-use order, named
after the variable the mod knows it by (a closure variable or a global of the mod or of a
function it calls), else ``captured<n>``.  A partial index (``bias[h]``) is a
``View`` that the next ``[...]`` completes; a 0-d tensor used as a value is a load with
no index.  ``ne.attention`` opens one ``capturing`` session per call and hands
``session.captured`` (placeholder name -> tensor) to the caller.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from . import dsl
from ..ir import ProgramError, Term

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64", torch.int32: "int32", torch.int64: "int64",
               torch.bool: "bool"}
_RESERVED = {"q", "k", "v", "s", "mx", "den", "o"}  # names ne.attention gives its own tensors


class Session:
    """The torch tensors one ``ne.attention`` call's mods captured, in first-use order."""

    def __init__(self, fns):
        self.hints = _known_names(fns)
        self.by_id: dict[int, tuple[torch.Tensor, dsl.Tensor]] = {}
        self.dtypes: dict[str, str] = {}

    def placeholder(self, t: torch.Tensor) -> dsl.Tensor:
        hit = self.by_id.get(id(t))  # the tensor is held in by_id, so its id stays unique
        if hit is not None:
            return hit[1]
        dtype = DTYPE_NAMES.get(t.dtype)
        if dtype is None:
            raise ProgramError(f"Expected a captured tensor of dtype {sorted(DTYPE_NAMES.values())}, "
                               f"got {t.dtype} (shape {tuple(t.shape)}); convert it outside the "
                               "mod, e.g. .to(torch.int32).")
        if any(n == 0 for n in t.shape):
            raise ProgramError(f"Expected a captured tensor with no empty dimension, got shape "
                               f"{tuple(t.shape)}; drop the mod's read of it.")
        name = self.hints.get(id(t))
        if not name or name in _RESERVED or name in self.dtypes or not name.isidentifier():
            name = f"captured{len(self.by_id)}"
        ph = dsl.placeholder(tuple(t.shape), dtype, name)
        self.by_id[id(t)] = (t, ph)
        self.dtypes[name] = dtype
        return ph

    @property
    def captured(self) -> dict[str, torch.Tensor]:
        return {ph.name: t for t, ph in self.by_id.values()}


_SESSIONS: list[Session] = []

# Tensors a mod computed, while traced, from tensors that existed before the trace
# (``(doc > 0)[q_idx]``: torch runs ``doc > 0`` eagerly, as a whole-tensor op).  Such a
# tensor is this call's data: a later call must compute it again from its own ``doc``
# (``dropin.eager_env`` traces such mods per call; under torch.compile it is an error;
# ``made_from_data`` tells).
# A tensor made from no existing one -- a literal, ``torch.tensor([...])[h]`` -- is a
# constant of the mod's code, and is not listed.
_MADE_FROM_DATA: dict[int, weakref.ref] = {}  # id -> the tensor, held weakly


def made_from_data(t) -> bool:
    """Whether ``t`` is a tensor a mod computed while traced from existing tensors."""
    ref = _MADE_FROM_DATA.get(id(t))
    return ref is not None and ref() is t


def _mark_made_from_data(t: torch.Tensor) -> None:
    key = id(t)  # (a WeakSet would compare tensors with ==, elementwise)
    _MADE_FROM_DATA[key] = weakref.ref(t, lambda _, key=key: _MADE_FROM_DATA.pop(key, None))


class _Provenance(TorchFunctionMode):
    """While a mod is traced: which tensors torch made from tensors that existed before
    (``made_from_data``).  The tensors made are held until the trace ends, so no two
    share an id."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        data = any(id(t) not in self.made or made_from_data(t)
                   for t in _tensors((args, kwargs)))
        for t in _tensors(out):
            self.made.setdefault(id(t), t)
            if data:
                _mark_made_from_data(t)
        return out


def _tensors(x):
    """The torch tensors in ``x`` (nested tuples, lists and dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


@contextmanager
def capturing(*fns):
    """Collect the torch tensors that ``fns`` (the mods) index while traced inside, and
    note which tensors they compute from existing ones (``made_from_data``)."""
    sess = Session([f for f in fns if f is not None])
    _SESSIONS.append(sess)
    try:
        with _Provenance():
            yield sess
    finally:
        _SESSIONS.pop()


def dtype_of(name: str) -> str | None:
    """The dtype of the tensor a load reads: a captured tensor, or an ne.placeholder the
    body being traced has read."""
    for sess in reversed(_SESSIONS):
        if name in sess.dtypes:
            return sess.dtypes[name]
    for cap in reversed(dsl._CAPTURES):
        for t in cap.tensors:
            if t.name == name:
                return t.dtype
    return None


def _known_names(fns, depth: int = 4) -> dict[int, str]:
    """id(tensor) -> the name a mod (or a function it calls) knows it by."""
    out: dict[int, str] = {}
    seen: set[int] = set()

    def visit(fn, d):
        if d < 0 or id(fn) in seen:
            return
        seen.add(id(fn))
        for inner in (getattr(fn, "func", None), getattr(fn, "__func__", None)):
            if inner is not None:  # functools.partial, bound method
                visit(inner, d - 1)
        code = getattr(fn, "__code__", None)
        if code is None:
            return
        cells = {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__ or ())
                 if _filled(c)}
        glb = getattr(fn, "__globals__", {})
        for n, obj in {**{n: glb[n] for n in code.co_names if n in glb}, **cells}.items():
            if isinstance(obj, torch.Tensor):
                out.setdefault(id(obj), n)
            elif callable(obj) and getattr(obj, "__module__", "") != "torch":
                visit(obj, d - 1)

    for f in fns:
        visit(f, depth)
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:  # a closure variable not assigned yet
        return False


def session() -> Session:
    if not _SESSIONS:
        raise ProgramError("Expected torch tensors only inside the mods of ne.attention, got one "
                           "indexed with neptune_eq expressions elsewhere; declare it with "
                           "ne.placeholder(shape, dtype, name) and pass it to the kernel.")
    return _SESSIONS[-1]


class View:
    """A captured tensor indexed in some leading dimensions (``bias[b]``); index the rest."""

    def __init__(self, ph: dsl.Tensor, idx: tuple[Term, ...]):
        self.ph, self.idx = ph, idx

    def __getitem__(self, index):
        return index_tensor(self.ph, self.idx, index)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from . import torch_mods  # torch.dot(view, ...): reported as an unsupported op
        return torch_mods.dispatch(func, args, kwargs or {})

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise ProgramError(f"Expected every dimension of captured tensor {self.ph.name} "
                           f"{list(self.ph.shape)} indexed before use, got Tensor.{name} on it "
                           f"after {len(self.idx)} index(es); reductions and reshapes of "
                           "captured tensors cannot run inside a mod (FlexAttention rejects "
                           "them too): precompute them outside into another captured tensor.")

    def incomplete(self) -> ProgramError:
        return ProgramError(f"Expected all {self.ph.ndim} dimensions of captured tensor "
                            f"{self.ph.name} {list(self.ph.shape)} indexed before use, got "
                            f"{len(self.idx)}; add the missing indices.")

    def __repr__(self):
        return f"View({self.ph.name}[{', '.join(map(str, self.idx))}, ...])"


def getitem(t, index):
    """``Tensor.__getitem__`` with expressions in the index."""
    if isinstance(t, View):
        return t[index]
    if not isinstance(t, torch.Tensor):
        raise ProgramError(f"Expected a captured torch tensor to index, got {type(t).__name__}.")
    return index_tensor(session().placeholder(t), (), index)


def scalar(t: torch.Tensor) -> dsl.Expr:
    """A captured tensor used as a value: only a 0-d one is a value."""
    if t.ndim:
        raise ProgramError(f"Expected a captured tensor of shape {tuple(t.shape)} to be indexed "
                           "before it is used as a value in a mod, got it whole; index it "
                           "with the mod's indices, e.g. bias[h, q_idx].")
    return index_tensor(session().placeholder(t), (), ())


def index_tensor(ph: dsl.Tensor, done: tuple[Term, ...], index):
    from .torch_mods import FLOAT, as_expr, kind
    items = index if isinstance(index, tuple) else (index,)
    idx = list(done)
    for it in items:
        if it is None or it is Ellipsis or isinstance(it, slice):
            raise ProgramError(f"Expected integer indices for captured tensor {ph.name} "
                               f"{list(ph.shape)} in a mod, got {it!r}; index each dimension "
                               "with an index expression (bias[h, q_idx]).")
        if len(idx) >= ph.ndim:
            raise ProgramError(f"Expected at most {ph.ndim} indices for captured tensor {ph.name} "
                               f"{list(ph.shape)}, got {len(done) + len(items)}; drop the extra ones.")
        if isinstance(it, int) and not isinstance(it, bool) and it < 0:
            it += ph.shape[len(idx)]  # torch's negative index counts from the end
        e = as_expr(it)
        if kind(e.term) == FLOAT:
            raise ProgramError(f"Expected an integer index into captured tensor {ph.name}, got "
                               f"the float expression {dsl.ir.fmt(e.term)}; use // or .long().")
        idx.append(e.term)
    if len(idx) < ph.ndim:
        return View(ph, tuple(idx))
    return ph[tuple(dsl.Expr(i) for i in idx)]
