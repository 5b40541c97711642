"""Loading rule files (``rules/*.egg``).

A rule file holds ``rewrite``, ``birewrite`` and ``rule`` commands written against the
constructors of ``terms.py``.  Every rule needs a unique kebab-case ``:name``; it joins
the ruleset named after the file (``rules/algebra.egg`` -> ``algebra``); in egglog each
rule gets a ruleset of its own (``algebra.exp-div``) so that single rules can be banned.  A file is
checked on a scratch e-graph first, so a bad file is rejected with ``file:line``, the
rule name and the reason, and leaves the real e-graph untouched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import egglog.bindings as bindings
from egglog import EGraph

from ..errors import RuleFileError
from . import terms
from .structural import analysis_rules, substitution_rules

RULES_DIR = Path(__file__).resolve().parents[2] / "rules"
_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_POS = re.compile(r"In (\d+):(\d+)")


@dataclass(frozen=True)
class RuleInfo:
    """Where a rule comes from and what it says."""
    name: str
    ruleset: str
    file: str
    line: int
    comment: str
    source: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def egg_ruleset(self) -> str:
        """Every rule sits in a ruleset of its own, so the back-off scheduler can leave a
        banned rule out of an iteration (egglog runs rulesets, not single rules)."""
        return rule_ruleset(self.ruleset, self.name)


def rule_ruleset(ruleset: str, name: str) -> str:
    return f"{ruleset}.{name}"


def shipped_rule_files() -> list[Path]:
    """The rule files that ship with neptune_eq, in load order."""
    return sorted(RULES_DIR.glob("*.egg"))


def _display(path: Path) -> str:
    """Shipped rules as ``rules/x.egg``; user files as given."""
    try:
        return str(path.resolve().relative_to(RULES_DIR.parent))
    except ValueError:
        return str(path)


def _line_of(text: str, offset: int) -> int:
    """egglog spans are byte offsets into the UTF-8 text."""
    return text.encode()[:offset].count(b"\n") + 1


def _comment_above(lines: list[str], line: int) -> str:
    out = []
    k = line - 2
    while k >= 0 and lines[k].strip().startswith(";"):
        out.append(lines[k].strip().lstrip(";").strip())
        k -= 1
    return " ".join(reversed(out))


def _error(path: Path, text: str, msg: str, rule: str | None = None) -> RuleFileError:
    m = _POS.search(msg)
    line = int(m.group(1)) if m else 0
    where = f"{path}:{line}" if line else str(path)
    first = msg.strip().splitlines()[-1] if msg.strip() else msg
    named = f" (rule {rule!r})" if rule else ""
    return RuleFileError(f"{where}{named}: {first}")


def new_egraph() -> EGraph:
    """An e-graph with every constructor and the structural rules declared."""
    eg = EGraph()
    terms.declare(eg)
    low = eg._egraph
    for text, name in ((analysis_rules(), "<analysis>"), (substitution_rules(), "<subst>")):
        low.run_program(*low.parse_program(text, filename=name))
    return eg


def parse_rule_file(path: Path | str, taken: set[str] | None = None,
                    ruleset: str | None = None) -> tuple[list, list[RuleInfo]]:
    """Parse and check one rule file; returns its commands (bound to its ruleset) and
    one ``RuleInfo`` per rule.  Raises ``RuleFileError``.

    A file's checked commands are kept per (path, ruleset, text) for the process: the
    check builds a scratch e-graph per file, 0.29 s for the five shipped files of a
    0.77 s softmax build on the CPU machine (session 30), paid again by every kernel a
    training step builds.  An edited file is a new text, parsed afresh; only the names
    ``taken`` by other files are checked per call."""
    path = Path(path)
    if not path.is_file():
        raise RuleFileError(f"Expected a rule file (.egg), got {str(path)!r} which does not exist.")
    text = path.read_text()
    ruleset = ruleset or re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")
    key = (str(path), ruleset, text)
    if key not in _CHECKED:
        if len(_CHECKED) >= 64:  # (rule files written on the fly: keep the memory bounded)
            _CHECKED.clear()
        _CHECKED[key] = _parse_and_check(path, text, ruleset)
    cmds, infos = _CHECKED[key]
    for info in infos:
        if taken and info.name in taken:
            raise _duplicate(path, info.line, info.name)
    return list(cmds), list(infos)


_CHECKED: dict[tuple, tuple[list, list[RuleInfo]]] = {}


def _duplicate(path: Path, line: int, name: str) -> RuleFileError:
    return RuleFileError(f"{path}:{line} (rule {name!r}): duplicate rule name; rule names "
                         "must be unique across all loaded rule files.")


def _parse_and_check(path: Path, text: str, ruleset: str) -> tuple[list, list[RuleInfo]]:
    """``parse_rule_file``'s work on one file's text, with no names taken elsewhere."""
    scratch = new_egraph()
    low = scratch._egraph
    try:
        cmds = low.parse_program(text, filename=str(path))
    except Exception as e:  # egglog raises EggSmolError
        raise _error(path, text, str(e)) from None
    lines = text.splitlines()
    out, infos, names = [], [], set()
    for c in cmds:
        if isinstance(c, bindings.RewriteCommand):
            rw = c.rewrite
            span, name = rw.span, rw.name
            new = bindings.RewriteCommand(rule_ruleset(ruleset, name), rw, c.subsume)
        elif isinstance(c, bindings.BiRewriteCommand):
            rw = c.rewrite
            span, name = rw.span, rw.name
            new = bindings.BiRewriteCommand(rule_ruleset(ruleset, name), rw)
        elif isinstance(c, bindings.RuleCommand):
            r = c.rule
            span, name = r.span, r.name
            new = bindings.RuleCommand(bindings.Rule(r.span, r.head, r.body, r.name,
                                                     rule_ruleset(ruleset, name)))
        else:
            span = getattr(c, "span", None)
            line = _line_of(text, span.i) if span is not None else 0
            raise RuleFileError(f"{path}:{line}: only rewrite, birewrite and rule commands may "
                                f"appear in a rule file, got {type(c).__name__}; declare "
                                "constructors in neptune_eq/egraph/terms.py instead.")
        line = _line_of(text, span.i)
        if not name:
            raise RuleFileError(f"{path}:{line}: every rule needs a name; add "
                                ':name "what-it-does" (kebab-case).')
        if not _NAME.match(name):
            raise RuleFileError(f"{path}:{line} (rule {name!r}): expected a kebab-case name like "
                                "'exp-sub-split'.")
        if name in names:
            raise _duplicate(path, line, name)
        names.add(name)
        src = text.encode()[span.i:span.j].decode(errors="replace")
        infos.append(RuleInfo(name, ruleset, _display(path), line, _comment_above(lines, line), src))
        out.append(new)
    # Type-check on the scratch e-graph: unknown constructors, unbound variables, bad sorts.
    try:
        for c, info in zip(out, infos):
            try:
                low.run_program(*low.parse_program(f"(ruleset {info.egg_ruleset})",
                                                   filename="<ruleset>"))
                low.run_program(c)
            except Exception as e:
                raise _error(path, text, str(e), info.name) from None
    except BaseException as e:  # egglog panics derive from BaseException
        if isinstance(e, (RuleFileError, KeyboardInterrupt)):
            raise
        raise RuleFileError(f"{path}: rejected by egglog: {e}") from None
    return out, infos
