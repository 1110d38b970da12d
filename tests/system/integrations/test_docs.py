"""The user guide, the runbook and the integrations' READMEs do not drift from the code.

Every ``psguard ...`` command they show parses with psguard's own CLI parser (a renamed flag or subcommand
fails here), every relative link points at a file that exists, and every in-page anchor at a heading.
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


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
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
