"""The package's folders are the pipeline: a stage imports only from stages before it.

Read from the source (``ast``), so lazy imports inside functions count too: a cycle that
only shows at call time is still a cycle."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "neptune_eq"

# Pipeline order.  "shared" is the language every stage speaks (IR, sizes, interpreter,
# errors); "entry" the public entry points (superoptimize, rules, CLI); "dropin" the torch
# drop-in built on them; "facade" the package's ``__init__`` that re-exports it all.
ORDER = ["shared", "frontend", "egraph", "lowering", "runtime", "choosing", "entry", "dropin",
         "facade"]
SHARED = {"ir", "sizes", "interp", "errors"}
# Stages that never need each other, though one comes first in ORDER.
INDEPENDENT = {("egraph", "frontend"), ("lowering", "frontend"), ("lowering", "egraph")}


def stage_of(parts: list[str]) -> str:
    """parts: module path under neptune_eq, e.g. ['choosing', 'cache']"""
    if len(parts) > 1 or parts[0] in ORDER:
        return parts[0]
    if parts[0] in ("__init__", "__main__"):
        return "facade"
    return "shared" if parts[0] in SHARED else "entry"


def imports_of(path: Path) -> set[tuple[str, ...]]:
    """Modules of the package that ``path`` imports (relative imports resolved)."""
    here = list(path.relative_to(PKG).with_suffix("").parts)
    pkg = here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "neptune_eq":
                target = node.module.split(".")[1:]
            else:
                continue
            if not target:  # from . import x, y: each name is a module of the package
                out |= {(a.name,) for a in node.names}
            elif target[0] in ORDER and len(target) == 1:  # from .egraph import saturate
                out |= {(target[0], a.name) for a in node.names}
            else:
                out.add(tuple(target))
    return out


def test_stages_import_only_earlier_stages():
    wrong = []
    for path in PKG.rglob("*.py"):
        mine = stage_of(list(path.relative_to(PKG).with_suffix("").parts))
        for target in imports_of(path):
            theirs = stage_of(list(target))
            if theirs == mine:
                continue
            if ORDER.index(theirs) > ORDER.index(mine) or (mine, theirs) in INDEPENDENT:
                wrong.append(f"{path.relative_to(PKG)} ({mine}) imports {'.'.join(target)} ({theirs})")
    assert not wrong, "imports against the pipeline:\n" + "\n".join(sorted(wrong))


def test_the_checker_sees_a_backward_import(tmp_path):
    # A lowering module importing the chooser must be reported: the test above can fail.
    fake = PKG / "lowering" / "_probe_backward.py"
    fake.write_text("from ..choosing import choose\n")
    try:
        assert ("choosing", "choose") in imports_of(fake)
        assert ORDER.index(stage_of(["choosing", "choose"])) > ORDER.index(stage_of(["lowering", "x"]))
    finally:
        fake.unlink()


def test_modules_stay_small():
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"split these modules (over 600 lines): {big}"
