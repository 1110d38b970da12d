"""The user guide, the runbook, the design notes, the benchmarks and the integrations' READMEs do not drift.

Every ``psguard ...`` command they show parses with psguard's own CLI parser (a renamed flag or subcommand
fails here), every relative link points at a file that exists, every in-page anchor at a heading, and every
section a docstring, comment or doc names by title (``docs/design.md, "Parity"``) is a heading of that file.
The design notes say what is, not when (the history is in git and docs/bench/history.md), and BENCHMARKS.md holds
the current figures only, so it stays small.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from psguard.cli import build_parser
from tests.support.paths import ROOT

DOCS = [
    ROOT / "docs" / "user-guide.md",
    ROOT / "docs" / "runbook.md",
    ROOT / "integrations" / "kubernetes" / "README.md",
    ROOT / "integrations" / "prometheus" / "README.md",
]
#: Files whose links and anchors must resolve: the docs above, the README, the design notes and the benchmarks.
LINKED = [
    *DOCS,
    ROOT / "README.md",
    ROOT / "BENCHMARKS.md",
    ROOT / "docs" / "design.md",
    ROOT / "docs" / "scaling.md",
    ROOT / "docs" / "bench" / "history.md",
]
#: The design notes state what is true now; dates belong to git and docs/bench/history.md.
UNDATED = [ROOT / "docs" / "design.md", ROOT / "docs" / "scaling.md"]
#: BENCHMARKS.md keeps one table per benchmark, of its newest run; older runs go to docs/bench/history.md.
BENCHMARKS_MAX_BYTES = 25_000
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
#: ``docs/design.md, "Parity"``, ``BENCHMARKS.md ("chaos soak")``, ``docs/design.md, "Peer copies", "Parity"``.
SECTION_REF = re.compile(
    r"(?P<doc>docs/design\.md|docs/scaling\.md|docs/storage-format\.md|docs/runbook\.md|docs/user-guide\.md"
    r"|BENCHMARKS\.md)\s*[,(]\s*\(?(?P<names>\"[^\"]+\"(?:\s*,\s*\"[^\"]+\")*)"
)
#: Where such names are written: the package, the tests, the docs (the history is a record of its time: not read).
REFERRING = [ROOT / "psguard", ROOT / "tests", ROOT / "docs", ROOT / "integrations", ROOT / "chaos"]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def _commands(text: str) -> list[str]:
    """``psguard ...`` lines of the fenced code blocks, comments dropped, continuation lines joined."""
    out = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("psguard "):
                out.append(line)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_psguard_command_shown_parses(doc: Path) -> None:
    commands = _commands(doc.read_text())
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{doc.name}: `{command}` does not parse (exit {e.code})")


def test_the_docs_show_commands_at_all() -> None:
    """The check above is not vacuous: the guide and the runbook show the commands users run."""
    shown = {shlex.split(c)[1] for doc in DOCS for c in _commands(doc.read_text())}
    assert {"wrap", "ls", "verify", "inspect", "export", "gc", "policy"} <= shown


def test_a_renamed_flag_would_fail() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(shlex.split("gc s3://b/p --keep-latest 5"))


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    text = doc.read_text()
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to missing {target}"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text()), f"{doc.name}: no heading for #{anchor} in {file.name}"


def _headings(text: str) -> list[str]:
    return [h.replace("`", "").lower() for h in re.findall(r"^#+ (.+)$", text, re.M)]


def _section_refs() -> list[tuple[str, str, str]]:
    """(where, doc, section title) for every section named by title, a docstring's line breaks and comment
    markers folded into one line first."""
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for folder in REFERRING:
        files += [p for p in sorted(folder.rglob("*")) if p.suffix in (".py", ".md", ".yaml") and p.is_file()]
    history = ROOT / "docs" / "bench" / "history.md"
    out = []
    for path in files:
        if path in (history, Path(__file__).resolve()):
            continue
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text())
        for m in SECTION_REF.finditer(text):
            for name in re.findall(r'"([^"]+)"', m["names"]):
                out.append((str(path.relative_to(ROOT)), m["doc"], name))
    return out


def test_sections_named_by_title_are_headings() -> None:
    """A docstring that sends its reader to ``docs/design.md, "Restore on the PS"`` finds a heading there."""
    refs = _section_refs()
    assert len(refs) >= 8, refs  # the package's docstrings name a dozen such sections: the scan finds them
    missing = [
        f"{where}: {doc}, {name!r}"
        for where, doc, name in refs
        if not any(name.replace("`", "").lower() in h for h in _headings((ROOT / doc).read_text()))
    ]
    assert not missing, "no heading with that title:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", UNDATED, ids=lambda p: str(p.relative_to(ROOT)))
def test_design_notes_carry_no_dates(doc: Path) -> None:
    dated = [line for line in doc.read_text().splitlines() if DATE.search(line)]
    assert not dated, f"{doc.name} says what is, not when (move the history to docs/bench/history.md): {dated[:3]}"


def test_benchmarks_holds_the_current_figures_only() -> None:
    size = (ROOT / "BENCHMARKS.md").stat().st_size
    assert size <= BENCHMARKS_MAX_BYTES, (
        f"BENCHMARKS.md is {size} bytes (at most {BENCHMARKS_MAX_BYTES}): keep each benchmark's newest run in one "
        "table and move the runs it supersedes to docs/bench/history.md"
    )
