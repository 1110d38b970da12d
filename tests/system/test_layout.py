"""The package's layout holds: each process loads only its own side, and the import rules stay true.

- ``psguard.trainer`` (runs in the user's training process) and ``psguard.agent`` (the sidecar) never import
  each other; both speak ``psguard.handoff``, which imports neither, nor ``psguard.store`` (the contract is a
  floor of its own, below the durable log).
- ``psguard.codec`` (what the contract and the log both encode: dtype names, tensor bytes, strict JSON) sits
  below both and imports no psguard module but its own.
- The agent's rooms build on one another in one direction only: ``psguard.agent.process`` (keeping a task alive)
  and ``psguard.agent.tiers`` (the checkpoint tiers) import no other room, ``psguard.agent.control`` (the
  control plane) may import ``process`` and nothing else, and no room imports the modules that wire them
  (``psguard.agent.daemon``, ``recovery``, ``config``, ``cli``, ``wrap``).
- ``psguard.store`` knows neither policies nor TensorFlow; the top floor (demo, chaos, testbed, benchmarks,
  the CLI) is imported by nothing below it.
- No import cycles, and no function-local import of psguard code below the top floor unless its line says
  why (``# lazy:``, for start-up time).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import paths

ROOT = paths.ROOT / "psguard"
TOP_FLOOR = ("psguard.demo", "psguard.demo_trainer", "psguard.chaos", "psguard.testbed", "psguard.benchmarks")
TOP_FLOOR += ("psguard.cli",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported psguard module, line, at module level) for every psguard import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []
    top_level = {id(n) for n in tree.body}
    for stmt in tree.body:  # `if TYPE_CHECKING:` blocks count as module level: they are not run
        if isinstance(stmt, ast.If):
            top_level.update(id(n) for n in stmt.body)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "psguard" or name.startswith("psguard."):
                out.append((name, node.lineno, id(node) in top_level))
    return out


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def loaded_after(code: str) -> set[str]:
    probe = code + "\nimport sys; print('\\n'.join(m for m in sys.modules if m.startswith('psguard')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_trainer_side_loads_no_agent_module() -> None:
    loaded = loaded_after("import psguard; psguard.CheckpointManager; import psguard.trainer, psguard.keras")
    assert "psguard.trainer.manager" in loaded
    assert not {m for m in loaded if under(m, "psguard.agent")}


def test_the_agent_side_loads_no_trainer_module() -> None:
    code = "import psguard.agent, psguard.agent.daemon, psguard.agent.wrap, psguard.agent.tiers.spool_server"
    loaded = loaded_after(code + ", psguard.agent.tiers.persister, psguard.agent.control.status")
    assert "psguard.agent.daemon" in loaded
    assert not {m for m in loaded if under(m, "psguard.trainer")}


def test_the_contract_loads_no_store_module() -> None:
    handoff = [m for m in modules() if under(m, "psguard.handoff")]
    loaded = loaded_after("import " + ", ".join(handoff))
    assert "psguard.handoff.spool" in loaded
    assert not {m for m in loaded if under(m, "psguard.store")}


def test_the_codec_imports_only_itself() -> None:
    bad = [
        f"{module}:{line} imports {name}"
        for module, path in modules().items()
        if under(module, "psguard.codec")
        for name, line, _ in imports(path)
        if not under(name, "psguard.codec")
    ]
    assert "psguard.codec" in modules()
    assert not bad, bad


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        ("psguard.trainer", ("psguard.agent",)),
        ("psguard.agent", ("psguard.trainer",)),
        ("psguard.handoff", ("psguard.trainer", "psguard.agent", "psguard.policy", "psguard.store")),
        ("psguard.store", ("psguard.trainer", "psguard.agent", "psguard.policy", "psguard.handoff")),
        ("psguard.storage", ("psguard.trainer", "psguard.agent", "psguard.policy", "psguard.store")),
        ("psguard.policy", ("psguard.trainer", "psguard.agent")),
    ],
)
def test_import_rules(side: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{module}:{line} imports {name}"
        for module, path in modules().items()
        if under(module, side)
        for name, line, _ in imports(path)
        if under(name, *forbidden) or under(name, *TOP_FLOOR)
    ]
    assert not bad, bad


AGENT_TOP = tuple(f"psguard.agent.{m}" for m in ("daemon", "recovery", "config", "cli", "wrap"))


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        ("psguard.agent.process", ("psguard.agent.tiers", "psguard.agent.control", *AGENT_TOP)),
        ("psguard.agent.tiers", ("psguard.agent.process", "psguard.agent.control", *AGENT_TOP)),
        ("psguard.agent.control", ("psguard.agent.tiers", *AGENT_TOP)),
    ],
)
def test_the_agents_rooms(room: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{module}:{line} imports {name}"
        for module, path in modules().items()
        if under(module, room)
        for name, line, _ in imports(path)
        if under(name, *forbidden)
    ]
    assert not bad, bad


def test_the_agent_keeps_few_modules_at_its_top() -> None:
    top = [p.name for p in (ROOT / "agent").glob("*.py")]
    assert len(top) <= 12, top


def test_no_module_is_too_long() -> None:
    """A reader walks one job per module: none over 800 lines."""
    long = {module: n for module, path in modules().items() if (n := len(path.read_text().splitlines())) > 800}
    assert not long, long


#: The most lines a function may span, its nested functions included (each of them is checked too).
FUNCTION_LINES = 80


def long_functions(path: Path, name: str) -> dict[str, int]:
    """``module:qualified.name`` -> lines of every function in ``path`` longer than :data:`FUNCTION_LINES`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > FUNCTION_LINES:
                    found[f"{name}:{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def test_no_function_is_too_long() -> None:
    """A function is read at once: none over 80 lines. A longer one is split where its jobs part (closures that
    share many locals become a small class), not squeezed."""
    long = {f: n for module, path in modules().items() for f, n in long_functions(path, module).items()}
    assert not long, long


def test_the_function_check_counts_nested_and_async_functions_and_methods(tmp_path: Path) -> None:
    def body(indent: int, n: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(n))

    n = FUNCTION_LINES - 2
    source = f"def short():\n{body(4, n)}    return 0\n\n"  # FUNCTION_LINES lines: within the limit
    source += f"async def outer():\n    def inner():\n{body(8, n)}        return 1\n    return inner\n\n"
    source += f"class C:\n    def method(self):\n{body(8, n + 1)}        return 2\n"
    (tmp_path / "m.py").write_text(source)
    got = long_functions(tmp_path / "m.py", "m")
    # inner alone is within the limit, outer with it is not; a method is named by its class.
    assert got == {"m:outer": FUNCTION_LINES + 2, "m:C.method": FUNCTION_LINES + 1}, got


def test_the_store_does_not_import_tensorflow() -> None:
    loaded = loaded_after("import psguard.store, psguard.store.cli; import sys; assert 'tensorflow' not in sys.modules")
    assert "psguard.store.facade" in loaded


def test_nothing_outside_the_chaos_harness_imports_it() -> None:
    bad = [
        f"{module} imports {name}"
        for module, path in modules().items()
        if not under(module, "psguard.chaos")
        for name, _, _ in imports(path)
        if under(name, "psguard.chaos")
    ]
    assert not bad, bad


def test_no_function_local_import_below_the_top_floor_without_a_reason() -> None:
    bad = []
    for module, path in modules().items():
        if under(module, *TOP_FLOOR):
            continue
        lines = path.read_text().splitlines()
        for name, line, top in imports(path):
            if top:
                continue
            # the reason is on the import's line or on a comment line above its block of imports
            i = line - 1
            while i > 0 and "# lazy:" not in lines[i] and lines[i].lstrip().startswith(("from ", "import ")):
                i -= 1
            if "# lazy:" not in lines[i]:
                bad.append(f"{module}:{line} imports {name} inside a function")
    assert not bad, bad


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {m: {n for n, _, top in imports(p) if top and n in mods and n != m} for m, p in mods.items()}
    # Importing a submodule runs its package's __init__ first, which may re-export from that very submodule:
    # that is not a cycle in the code, so edges into a package from its own submodules are left out.
    for m in graph:
        graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail(" -> ".join(cycle))


def test_old_public_import_paths_still_work() -> None:
    code = (
        "import psguard\n"
        "from psguard import CheckpointManager, Store\n"
        "from psguard.store import Store as S2\n"
        "from psguard.keras import CheckpointCallback\n"
        "from psguard.recovery import run_with_recovery\n"
        "from psguard.tensors import Full, Rows\n"
        "from psguard.agent import restart_ps_servers\n"
        "assert S2 is Store and CheckpointManager.__name__ == 'CheckpointManager'\n"
    )
    env_code = "import os; os.environ['TF_USE_LEGACY_KERAS'] = '1'\n" + code
    subprocess.run([sys.executable, "-c", env_code], check=True, timeout=180, capture_output=True)
