"""``ne.rules``: list, load and check rule files.

    ne.rules.load("my_rules.egg")      # checked now; used by every later superoptimize
    ne.rules.check("my_rules.egg")     # soundness report, one line per rule

Every user rule file is checked for soundness when it is loaded, with the same checker as
``neptune-eq rules check``: a rule proved wrong is refused with its counter-example, and a
rule the checker can neither prove nor refute is refused unless the caller opts in with
``allow_unchecked=True`` (the trace then says so).  The shipped files are checked by the
test suite instead (``tests/test_rules.py``), so a plain ``superoptimize`` pays nothing.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .errors import RuleFileError, UnsoundRuleError

if TYPE_CHECKING:
    from .egraph.rulefiles import RuleInfo
    from .egraph.verify import RuleCheck

__all__ = ["load", "loaded", "unload_all", "check", "vet", "listing", "shipped_rule_files",
           "RuleFileError", "UnsoundRuleError"]

_LOADED: list[Path] = []
_ALLOWED_UNCHECKED: set[Path] = set()
_VETTED: dict[tuple[str, bool], list] = {}   # (content hash, allow_unchecked) -> checks


def shipped_rule_files() -> list[Path]:
    """The rule files that ship with neptune_eq, in load order."""
    from .egraph.rulefiles import shipped_rule_files as shipped
    return shipped()


def load(path: str | Path, *, allow_unchecked: bool = False) -> list[RuleInfo]:
    """Check a user rule file and add it to every later ``ne.superoptimize`` call.

    Raises ``RuleFileError`` (file:line, rule name, reason) for a file that does not load,
    and ``UnsoundRuleError`` for a rule that is refuted, or that can be neither proved nor
    refuted unless ``allow_unchecked=True``.

        >>> ne.rules.load("my.egg")          # doctest: +SKIP
        [RuleInfo(name='my-exp-mul', ...)]
    """
    from .egraph.rulefiles import parse_rule_file
    p = Path(path)
    taken = {i.name for f in shipped_rule_files() + _LOADED for i in parse_rule_file(f)[1]}
    _, infos = parse_rule_file(p, taken)
    vet([p], allow_unchecked=allow_unchecked)
    if p.resolve() not in [q.resolve() for q in _LOADED]:
        _LOADED.append(p)
    if allow_unchecked:
        _ALLOWED_UNCHECKED.add(p.resolve())
    return infos


def loaded() -> list[Path]:
    """User rule files added with ``load``."""
    return list(_LOADED)


def loaded_unchecked_ok(path: Path) -> bool:
    """Whether ``load(path, allow_unchecked=True)`` opted this file in."""
    return path.resolve() in _ALLOWED_UNCHECKED


def unload_all() -> None:
    """Forget every file added with ``load``."""
    _LOADED.clear()
    _ALLOWED_UNCHECKED.clear()


def check(path: str | Path) -> list[RuleCheck]:
    """Prove or test every rule of a file; an unsound rule comes back with status
    ``UNSOUND`` and a counter-example.

        >>> [c.status for c in ne.rules.check("my.egg")]     # doctest: +SKIP
        ['proved']
    """
    from .egraph.verify import check_rule_file
    return check_rule_file(path)


def vet(paths: Sequence[str | Path], *, allow_unchecked: bool = False) -> list[str]:
    """Check user rule files before they are used; one trace line per file.

    Shipped files are skipped (the test suite proves them).  Results are remembered per
    file content, so re-using a file costs nothing."""
    shipped = {f.resolve() for f in shipped_rule_files()}
    lines = []
    for path in map(Path, paths):
        if path.resolve() in shipped:
            continue
        allow = allow_unchecked or loaded_unchecked_ok(path)
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            raise RuleFileError(f"Expected a readable rule file, got {str(path)!r} ({e.strerror}); "
                                "check the path.") from None
        key = (digest, allow)
        if key not in _VETTED:
            _VETTED[key] = _vet_one(path, allow)
        lines.append(_VETTED[key])
    return lines


def _vet_one(path: Path, allow_unchecked: bool) -> str:
    results = check(path)
    for r in results:
        if r.status == "UNSOUND":
            raise UnsoundRuleError(
                f"{r.where}: rule {r.name!r} is unsound and was refused ({r.method}): {r.detail}. "
                f"Fix the rule or its side condition; `neptune-eq rules check {path}` re-checks it.")
    unchecked = [r for r in results if r.status == "unchecked"]
    if unchecked and not allow_unchecked:
        r = unchecked[0]
        raise UnsoundRuleError(
            f"{r.where}: rule {r.name!r} could be neither proved nor refuted ({r.detail}); "
            f"{len(unchecked)} such rule(s) in {path}. Pass allow_unchecked_rules=True to "
            "superoptimize (or allow_unchecked=True to ne.rules.load) to use them anyway; the "
            "trace will list them, and translation validation still checks the result.")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    line = f"{path}: {summary}"
    if unchecked:
        line += " (used unchecked by opt-in: " + ", ".join(r.name for r in unchecked) + ")"
    return line


def listing(paths: list[str | Path] | None = None) -> list[RuleInfo]:
    """Every rule of the given files (default: shipped and loaded), with file:line."""
    from .egraph.rulefiles import parse_rule_file
    out: list[RuleInfo] = []
    for f in paths or shipped_rule_files() + _LOADED:
        out.extend(parse_rule_file(f)[1])
    return out
