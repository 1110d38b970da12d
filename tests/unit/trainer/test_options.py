"""The manager's and the Keras callback's options: old keyword arguments move to their fields with a warning
that names the new spelling, and an old argument given beside the same field is refused.

No TensorFlow here: the options and their translation are plain data (the manager's and the callback's own
tests check that the moved values take effect).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import warnings
from typing import Any

import pytest

from psguard.errors import ConfigError
from psguard.policy.engine import Retention
from psguard.policy.files import HangSpec
from psguard.trainer.options import (
    CALLBACK_MOVES,
    MANAGER_MOVES,
    CallbackOptions,
    CaptureOptions,
    DeprecatedCallbackArgs,
    DeprecatedManagerArgs,
    ManagerOptions,
    apply_deprecated,
    manager_options_from,
)
from tests.support.paths import ROOT

#: A value for each old keyword argument of the manager that differs from its field's default, and the field
#: it must land in with the value it must have there.
MANAGER_VALUES: dict[str, tuple[Any, str, Any]] = {
    "coordinator": (coord := object(), "coordinator", coord),
    "retention": (Retention(keep_last=2), "retention", Retention(keep_last=2)),
    "watch_policy": (False, "watch_policy", False),
    "storage_options": ({"endpoint_url": "http://x"}, "storage_options", {"endpoint_url": "http://x"}),
    "data_position": (position := (lambda: 3), "data_position", position),
    "new_base_after": (5, "new_base_after", 5),
    "preemption": (True, "preemption", True),
    "store": (store := object(), "store", store),
    "capturer_options": ({"verify_every": 2}, "capture", CaptureOptions(verify_every=2)),
    "spool": ("/dev/shm/s", "spool", "/dev/shm/s"),
    "restore_timeout": (7.5, "restore_timeout", 7.5),
    "hang": (HangSpec(after=9.0), "hang", HangSpec(after=9.0)),
    "summaries": ("logs/p", "summaries", "logs/p"),
}


def moved(options: Any, given: dict[str, Any], moves: Any) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = apply_deprecated(options, given, moves, callee="X", stacklevel=2)
    return result, caught


def test_every_old_manager_argument_has_a_value_here() -> None:
    assert set(MANAGER_VALUES) == set(DeprecatedManagerArgs.__annotations__) == set(MANAGER_MOVES)


@pytest.mark.parametrize("name", sorted(MANAGER_VALUES))
def test_an_old_manager_argument_warns_with_its_new_spelling_and_lands_in_its_field(name: str) -> None:
    value, field, want = MANAGER_VALUES[name]
    options, caught = moved(ManagerOptions(), {name: value}, MANAGER_MOVES)
    assert getattr(options, field) == want
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, f"`{name}=` is deprecated; use `{MANAGER_MOVES[name].spelling}`")
    ]
    spelling = MANAGER_MOVES[name].spelling
    assert spelling.startswith("options=psguard.ManagerOptions(") and f"{field}=" in spelling
    # Every other field kept its default: the move touched one field only.
    assert dataclasses.replace(options, **{field: getattr(ManagerOptions(), field)}) == ManagerOptions()


@pytest.mark.parametrize("name", sorted(MANAGER_VALUES))
def test_an_old_manager_argument_beside_its_field_in_options_is_refused(name: str) -> None:
    value, field, want = MANAGER_VALUES[name]
    options = ManagerOptions(**{field: want})
    with pytest.raises(ConfigError, match=rf"`{name}=` \(deprecated\) and `options\.{field}` are both given"):
        moved(options, {name: value}, MANAGER_MOVES)


def test_an_old_argument_beside_another_field_of_options_is_combined() -> None:
    options, _ = moved(ManagerOptions(restore_timeout=3.0), {"new_base_after": 4}, MANAGER_MOVES)
    assert options == ManagerOptions(restore_timeout=3.0, new_base_after=4)


def test_the_warning_points_at_the_callers_line() -> None:
    _, caught = moved(ManagerOptions(), {"spool": "/s"}, MANAGER_MOVES)
    assert caught[0].filename == __file__


def test_an_unknown_keyword_argument_is_a_type_error_as_python_gives_it() -> None:
    with pytest.raises(TypeError, match=r"X\(\) got an unexpected keyword argument 'sppol'"):
        moved(ManagerOptions(), {"sppol": "/s"}, MANAGER_MOVES)


def test_an_unknown_key_of_the_old_capturer_options_is_named() -> None:
    with pytest.raises(ConfigError, match=r"capturer_options: unknown key 'verify_evry'"):
        moved(ManagerOptions(), {"capturer_options": {"verify_evry": 2}}, MANAGER_MOVES)


def test_capture_options_give_the_capturer_only_what_was_set() -> None:
    assert CaptureOptions().capturer_kwargs() == {}
    tuned = CaptureOptions(row_tracking_min_rows=64, spill_dirs={"ps:0": "/p"})
    assert tuned.capturer_kwargs() == {"row_tracking_min_rows": 64, "spill_dirs": {"ps:0": "/p"}}


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ManagerOptions().spool = "/s"  # type: ignore[misc]


# ----------------------------------------------------------------------------------------- Keras callback
def test_every_old_callback_argument_but_save_every_n_steps_moves_into_its_options() -> None:
    # save_every_n_steps became BackupAndRestore's save_freq: the callback moves it (its own test).
    assert set(CALLBACK_MOVES) == set(DeprecatedCallbackArgs.__annotations__) - {"save_every_n_steps"}


@pytest.mark.parametrize(
    ("name", "value", "want"),
    [
        ("max_to_keep", 3, CallbackOptions(max_to_keep=3)),
        ("save_at_end", False, CallbackOptions(save_at_end=False)),
        ("summaries", False, CallbackOptions(summaries=False)),
        ("storage_options", {"a": 1}, CallbackOptions(manager=ManagerOptions(storage_options={"a": 1}))),
        (
            "manager_options",
            {"new_base_after": 2, "capturer_options": {"probe_rows": 0}},
            CallbackOptions(manager=ManagerOptions(new_base_after=2, capture=CaptureOptions(probe_rows=0))),
        ),
    ],
)
def test_an_old_callback_argument_warns_with_its_new_spelling_and_lands_in_its_field(
    name: str, value: Any, want: CallbackOptions
) -> None:
    options, caught = moved(CallbackOptions(), {name: value}, CALLBACK_MOVES)
    assert options == want
    assert [str(w.message) for w in caught] == [f"`{name}=` is deprecated; use `{CALLBACK_MOVES[name].spelling}`"]
    assert CALLBACK_MOVES[name].spelling.startswith("options=psguard.keras.CallbackOptions(")


def test_old_storage_options_beside_the_same_key_of_old_manager_options_is_refused() -> None:
    given = {"storage_options": {"a": 1}, "manager_options": {"storage_options": {"a": 2}}}
    with pytest.raises(ConfigError, match=r"`storage_options=` \(deprecated\) and `options\.manager\.storage_options`"):
        moved(CallbackOptions(), given, CALLBACK_MOVES)


def test_old_manager_options_beside_options_manager_is_refused() -> None:
    options = CallbackOptions(manager=ManagerOptions(new_base_after=1))
    with pytest.raises(ConfigError, match=r"`manager_options=` \(deprecated\) and `options\.manager` are both given"):
        moved(options, {"manager_options": {"preemption": True}}, CALLBACK_MOVES)


def test_an_unknown_key_of_the_old_manager_options_is_named() -> None:
    with pytest.raises(ConfigError, match=r"manager_options: unknown key 'polcy'"):
        manager_options_from({"polcy": "steady"})


# ------------------------------------------------------------------------------- psguard's own callers
#: Where psguard's own calls live: the package, its tests, the examples and the docs' scripts.
CALLERS = ("psguard", "tests", "integrations", "docs")
#: The docs whose Python code blocks users copy.
DOCS = ("README.md", "docs/user-guide.md")
#: This module and the surface's own tests spell old arguments on purpose (through ``**{name: value}``, which no
#: scan sees; listed in case one ever does not).
ON_PURPOSE = {
    "tests/unit/trainer/test_options.py",
    "tests/unit/trainer/test_manager.py",
    "tests/unit/trainer/test_keras.py",
}


def old_spellings(source: str, where: str) -> list[str]:
    """``where:line: Callee(old=)`` for each call in ``source`` (and in any Python a string literal of it holds: a
    child process's script) that passes an old keyword argument of the manager or the callback."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # a doc's fragment, not a program
    old = {"CheckpointManager": set(MANAGER_MOVES), "CheckpointCallback": set(DeprecatedCallbackArgs.__annotations__)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "Checkpoint" in node.value:
            found += old_spellings(node.value, f"{where}:{node.lineno} (a string's script)")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        found += [f"{where}:{node.lineno}: {name}({k.arg}=)" for k in node.keywords if k.arg in old.get(name, ())]
    return found


def test_psguards_own_callers_use_the_new_spelling() -> None:
    """No warning of psguard's deprecations ever comes from psguard's own code, tests, examples or docs, including
    the scripts they run as child processes (where no test's warning filter reaches)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *CALLERS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    found = []
    for rel in sorted(set(listed) - ON_PURPOSE):
        if rel.endswith(".py") and (ROOT / rel).is_file():
            found += old_spellings((ROOT / rel).read_text(), rel)
    for rel in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", (ROOT / rel).read_text(), re.S)
        found += [hit for block in blocks for hit in old_spellings(block, rel)]
    assert not found, found


def test_the_scan_sees_an_old_spelling_in_code_and_in_a_childs_script() -> None:
    code = (
        'm = psguard.CheckpointManager(c, u, spool=s)\nSCRIPT = """\nCheckpointCallback(u, save_every_n_steps=3)\n"""\n'
    )
    assert old_spellings(code, "x.py") == [
        "x.py:1: CheckpointManager(spool=)",
        "x.py:2 (a string's script):2: CheckpointCallback(save_every_n_steps=)",
    ]
    assert old_spellings("CheckpointManager(c, u, options=ManagerOptions(spool=s))", "y.py") == []
