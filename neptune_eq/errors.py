"""The errors neptune_eq raises on purpose.  Each message says what was expected, what
was given, and what to try.  Kept apart from the stages that raise them so that catching
one never imports egglog, sympy or triton."""
from __future__ import annotations

from .ir import ProgramError

__all__ = ["ProgramError", "RuleFileError", "UnsoundRuleError", "TranslationValidationError",
           "DeviceFaultError"]


class RuleFileError(ValueError):
    """A rule file that cannot be loaded: it does not parse, names an unknown
    constructor, reuses a rule name, ... (``file:line``, rule name, reason)."""


class UnsoundRuleError(RuleFileError):
    """A rule the soundness checker refuted (with its counter-example), or one it could
    neither prove nor refute while ``allow_unchecked_rules`` was not given."""


class TranslationValidationError(RuntimeError):
    """The chosen program (or its kernel) disagrees with the input program on random
    inputs: never returned, always raised, naming the rules on the derivation path."""


class DeviceFaultError(RuntimeError):
    """A kernel faulted on the GPU (an illegal memory access, a trap): the process's CUDA
    context is lost, so nothing more can run in it.  Raised where the fault is met while
    timing a config, naming the kernel and the config; not a number, not a later crash."""
