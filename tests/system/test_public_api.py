"""The public API is what the docs teach: every import and name the README and the user guide show works as
shown, the errors a caller catches are exported from ``psguard``, and the guide's table of
``CheckpointManager`` arguments is the real signature (names, order, defaults), so the two cannot drift.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import psguard
import psguard.errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "README.md", ROOT / "docs" / "user-guide.md")
TABLE_HEADING = "### `CheckpointManager` arguments"
#: A name the docs use through the package: ``psguard.CheckpointManager``, ``psguard.keras.CheckpointCallback``.
DOTTED = re.compile(r"(?<![\w.])psguard(?:\.[A-Za-z_]\w*)+")


def code_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block of ``path``."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    lang = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if current is None:
                lang, current = stripped[3:].strip(), []
            else:
                blocks.append((lang, current))
                current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{path}: a code block is not closed"
    return blocks


def import_lines(lines: list[str]) -> list[str]:
    return [s for line in lines if (s := line.strip()).startswith(("from psguard", "import psguard"))]


def doc_imports() -> list[str]:
    found = {line for path in DOCS for _, lines in code_blocks(path) for line in import_lines(lines)}
    return sorted(found)


def run(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (as a user's script starts) and return the JSON it prints last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_docs_show_imports_to_check() -> None:
    found = doc_imports()
    assert "import psguard" in found and "import psguard.keras" in found, found


@pytest.mark.parametrize("line", doc_imports())
def test_each_import_the_docs_show_works(line: str) -> None:
    assert run(f"{line}\nimport json; print(json.dumps({{}}))") == {}


def test_each_name_the_docs_code_uses_resolves() -> None:
    """Each Python block's imports, then every ``psguard.X.Y`` it uses, by attribute access as the user's code
    does it (``psguard.run_with_recovery`` after ``import psguard``)."""
    checks: list[tuple[str, list[str], list[str]]] = []
    for path in DOCS:
        for lang, lines in code_blocks(path):
            names = sorted({m.group(0) for line in lines for m in DOTTED.finditer(line.split("#", 1)[0])})
            if lang in ("python", "py") and names:
                checks.append((f"{path.name}: {names}", import_lines(lines), names))
    assert any("psguard.CheckpointManager" in names for _, _, names in checks), checks
    code = (
        "import functools, json\n"
        f"checks = {checks!r}\n"
        "failed = []\n"
        "for where, imports, names in checks:\n"
        "    for line in imports:\n"
        "        exec(line)\n"
        "    import psguard\n"
        "    for name in names:\n"
        "        try:\n"
        "            functools.reduce(getattr, name.split('.')[1:], psguard)\n"
        "        except AttributeError as e:\n"
        "            failed.append(f'{where}: {name}: {e}')\n"
        "print(json.dumps({'failed': failed}))\n"
    )
    assert run(code) == {"failed": []}


def test_import_psguard_is_light_and_every_exported_name_resolves() -> None:
    code = (
        "import json, sys\n"
        "import psguard\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow' or m.startswith(\n"
        "    ('psguard.trainer', 'psguard.agent', 'psguard.handoff')))\n"
        "missing = [n for n in psguard.__all__ if getattr(psguard, n, None) is None]\n"
        "keras = psguard.keras.CheckpointCallback.__name__\n"
        "names = {}\n"
        "exec('from psguard import *', names)\n"
        "print(json.dumps({'heavy': heavy, 'missing': missing, 'keras': keras,\n"
        "                  'star': sorted(n for n in psguard.__all__ if n not in names)}))\n"
    )
    assert run(code) == {"heavy": [], "missing": [], "keras": "CheckpointCallback", "star": []}


def test_every_error_a_caller_catches_is_exported() -> None:
    errors = {
        name: obj
        for name, obj in vars(psguard.errors).items()
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == "psguard.errors"
    }
    assert "PsguardError" in errors and "StorageUnavailableError" in errors
    assert sorted(set(errors) - set(psguard.__all__)) == []
    assert all(getattr(psguard, name) is cls for name, cls in errors.items())


def guide_table(heading: str = TABLE_HEADING, *, tables: int = 1, cells: int = 3) -> list[tuple[str, str, str]]:
    """(name, default, meaning) rows of the first ``tables`` tables after ``heading`` in the user guide, up to the
    next heading (a table's header row and its rule are not rows)."""
    lines = (ROOT / "docs" / "user-guide.md").read_text().splitlines()
    start = lines.index(heading)
    rows: list[tuple[str, str, str]] = []
    seen = 0
    in_table = False
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            in_table = False
            if seen == tables:
                break
            continue
        if not in_table:
            in_table, seen = True, seen + 1
        row = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(row) == cells, line
        if set(row[0]) <= {"-", " "} or not row[0].startswith("`"):
            continue  # the rule, or the header row
        rows.append((row[0], row[1], row[2] if cells == 3 else ""))
    return rows


def assert_rows_are(rows: list[tuple[str, str, str]], params: list[tuple[str, object]], names: dict[str, Any]) -> None:
    """Each row names the parameter (or field) in its place, with its default; ``names`` are the options classes a
    default may be an instance of (``CaptureOptions()``)."""
    assert [name.strip("`") for name, _, _ in rows] == [name for name, _ in params]
    for (_, default, meaning), (name, value) in zip(rows, params, strict=True):
        assert meaning, name
        if value is inspect.Parameter.empty:
            assert default == "required", name
            continue
        assert default.startswith("`") and default.endswith("`"), (name, default)
        text = default.strip("`")
        documented = names[text.removesuffix("()")]() if text.removesuffix("()") in names else ast.literal_eval(text)
        assert documented == value and type(documented) is type(value), (name, default)


def test_the_guides_table_of_manager_arguments_is_the_signature() -> None:
    """TF's arguments and psguard's three; the old keyword arguments (``**deprecated``) are the note's."""
    pytest.importorskip("tensorflow")
    params = list(inspect.signature(psguard.CheckpointManager.__init__).parameters.values())[1:]
    named = [(p.name, p.default) for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert_rows_are(guide_table(), named, {})


def test_the_guides_tables_of_options_are_the_fields() -> None:
    from psguard.trainer.options import CallbackOptions, CaptureOptions, ManagerOptions

    names = {"CaptureOptions": CaptureOptions, "ManagerOptions": ManagerOptions}
    for cls, heading, tables in (
        (ManagerOptions, "#### `psguard.ManagerOptions` fields", 5),
        (CallbackOptions, "### `CheckpointCallback` arguments", 1),
    ):
        defaults = [(f.name, getattr(cls(), f.name)) for f in dataclasses.fields(cls)]
        assert_rows_are(guide_table(heading, tables=tables), defaults, names)


def test_the_guides_note_on_deprecated_arguments_names_each_one() -> None:
    from psguard.trainer.options import DeprecatedCallbackArgs, DeprecatedManagerArgs

    old_column = " ".join(old for old, _, _ in guide_table("#### Deprecated arguments", tables=1, cells=2))
    for name in [*DeprecatedManagerArgs.__annotations__, *DeprecatedCallbackArgs.__annotations__]:
        assert re.search(rf"\b{name}\b", old_column), name
