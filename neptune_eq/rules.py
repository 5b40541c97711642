"""``ne.rules``: list, load and check rule files.

    ne.rules.load("my_rules.egg")      # validated now; used by every later superoptimize
    ne.rules.check("my_rules.egg")     # soundness report, one line per rule
"""
from __future__ import annotations

from pathlib import Path

from .egraph.rulefiles import RuleFileError, RuleInfo, parse_rule_file, shipped_rule_files
from .verify import RuleCheck, check_rule_file

__all__ = ["load", "loaded", "check", "listing", "shipped_rule_files", "RuleFileError"]

_LOADED: list[Path] = []


def load(path: str | Path) -> list[RuleInfo]:
    """Validate a user rule file and add it to every later ``ne.superoptimize`` call.
    Raises ``RuleFileError`` (with file:line, rule name and reason) for a bad file."""
    p = Path(path)
    taken = {i.name for f in shipped_rule_files() + _LOADED for i in parse_rule_file(f)[1]}
    _, infos = parse_rule_file(p, taken)
    if p.resolve() not in [q.resolve() for q in _LOADED]:
        _LOADED.append(p)
    return infos


def loaded() -> list[Path]:
    """User rule files added with ``load``."""
    return list(_LOADED)


def unload_all() -> None:
    _LOADED.clear()


def check(path: str | Path) -> list[RuleCheck]:
    """Prove or test every rule of a file; an unsound rule comes back with status
    ``UNSOUND`` and a counter-example."""
    return check_rule_file(path)


def listing(paths: list[str | Path] | None = None) -> list[RuleInfo]:
    """Every rule of the given files (default: shipped and loaded), with file:line."""
    out: list[RuleInfo] = []
    for f in paths or shipped_rule_files() + _LOADED:
        out.extend(parse_rule_file(f)[1])
    return out
