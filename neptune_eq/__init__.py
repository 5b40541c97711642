"""neptune_eq: an equality-saturation superoptimizer for chains of GPU reductions.

    import neptune_eq as ne
    x = ne.placeholder((64, 1000), "float32", "x")
    ...                                  # write the plain computation with ne.compute
    kern = ne.superoptimize(y)           # e-graph -> rules -> cost model -> Triton kernel
    print(kern.explain())

The public surface is ``__all__``; everything else lives in submodules.  Only the DSL
loads eagerly: the e-graph (egglog), the verifier (sympy) and code generation (triton)
load on first use, so ``import neptune_eq`` costs little more than ``import torch``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .runtime.triton_mode import prefer_interpreter_without_gpu as _prefer_interpreter

_prefer_interpreter()  # before anything imports triton: CPU-only machines interpret
from .frontend.dsl import (placeholder, reduce_axis, compute, sum, max, min, exp, exp2, log, tanh,  # noqa: A004,E402
                  sqrt, rsqrt, abs, maximum, minimum, where, cast, build_program)
from .sizes import size  # noqa: E402
# Eager, and light (the DSL and torch only): a lazy ``attention`` would lose to its own
# submodule if the two shared a name (they no longer do: it lives in ``frontend``).
from .frontend.attention import attention  # noqa: E402
from .errors import (DeviceFaultError, ProgramError, RuleFileError,  # noqa: E402
                     TranslationValidationError, UnsoundRuleError)

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from . import rules
    from .api import Kernel, superoptimize
    from .dropin.flex import flex_attention
    from .dropin.autograd import differentiable
    from .egraph.saturate import Limits

__all__ = [
    # write a program
    "placeholder", "reduce_axis", "compute", "build_program", "size",
    "sum", "max", "min", "exp", "exp2", "log", "tanh", "sqrt", "rsqrt", "abs",
    "maximum", "minimum", "where", "cast",
    "attention", "flex_attention",
    # superoptimize it
    "superoptimize", "Kernel", "Limits", "rules", "differentiable",
    # errors
    "ProgramError", "RuleFileError", "UnsoundRuleError", "TranslationValidationError",
    "DeviceFaultError",
]

# name -> (module, attribute or None for the module itself): loaded on first access.
_LAZY = {
    "superoptimize": (".api", "superoptimize"),
    "Kernel": (".api", "Kernel"),
    "flex_attention": (".dropin.flex", "flex_attention"),
    "differentiable": (".dropin.autograd", "differentiable"),
    "Limits": (".egraph.saturate", "Limits"),
    "rules": (".rules", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'neptune_eq' has no attribute {name!r}; the public names "
                             f"are {', '.join(__all__)}.")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module, __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
