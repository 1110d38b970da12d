"""Every module of psguard is imported by at least one file under tests/: a module no test imports is tested, if at
all, only by accident of what imports it, and a change to it is checked by nothing that names it.

Imports are read with ``ast`` (``import psguard.x``, ``from psguard.x import y``, ``from psguard import x`` where
``x`` is a submodule), anywhere in a file (inside a test function too); importing a module runs its packages'
``__init__`` first, so those count as imported. A child-process script given as a string does not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "psguard"
TESTS = ROOT / "tests"


def module_names() -> set[str]:
    """Every module under psguard/ (packages' ``__init__`` as the package itself)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def imported_by(path: Path, modules: set[str]) -> set[str]:
    """The psguard modules ``path`` imports (a ``from package import name`` counts ``package.name`` if a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found & modules


def untested(modules: set[str], test_files: list[Path]) -> set[str]:
    seen: set[str] = set()
    for path in test_files:
        for name in imported_by(path, modules):
            parts = name.split(".")
            seen.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return modules - seen


#: Modules still waiting for a test that imports them (mostly the top floor: CLIs, the chaos runner, the demo and
#: benchmark trainers, which tests run as child processes). This list only shrinks: a module on it that a test
#: imports fails the check until it is taken off.
NOT_YET = frozenset(
    {
        "psguard.agent.control.status",
        "psguard.agent.process.tree",
        "psguard.benchmarks.follow",
        "psguard.benchmarks.wrap",
        "psguard.chaos.cli",
        "psguard.demo",
        "psguard.policy.cli",
        "psguard.store.cli",
        "psguard.store.follow",
        "psguard.trainer.restore_status",
        "psguard.trainer.warm",
    }
)


def test_every_module_is_imported_by_a_test() -> None:
    modules = module_names()
    assert "psguard.store.durable" in modules and "psguard" in modules  # the walk sees the package
    missing = untested(modules, sorted(TESTS.rglob("*.py")))
    new = missing - NOT_YET
    assert not new, f"no file under tests/ imports {sorted(new)}: add a test in tests/unit/<package>/"
    done = NOT_YET - missing
    assert not done, f"tests now import {sorted(done)}: take them off NOT_YET"


def test_the_check_sees_a_module_no_test_imports(tmp_path: Path) -> None:
    """The check can fail: a module that only a non-test file imports is reported, and each import form counts."""
    modules = {"psguard", "psguard.a", "psguard.b", "psguard.c", "psguard.pkg", "psguard.pkg.d", "psguard.other"}
    (tmp_path / "test_x.py").write_text(
        "import psguard.a\nfrom psguard.pkg import d\n\ndef test_it():\n    from psguard import b\n"
        "    script = 'import psguard.c'\n"
    )
    assert untested(modules, [tmp_path / "test_x.py"]) == {"psguard.c", "psguard.other"}
