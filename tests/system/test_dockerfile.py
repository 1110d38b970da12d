"""The Dockerfile: read statically on every run; built and run for real where a docker daemon answers.

The static tests parse the Dockerfile into instructions and check what a reviewer would: a separate build stage
for the wheel, a runtime stage that ends as a non-root user, nothing fetched with ADD, no secret in an ARG, ENV or
COPY, a build context (``.dockerignore``) that lets in exactly what the Dockerfile copies, and the image name the
Kubernetes manifests run. The slow test builds the image with ``docker build`` and runs ``psguard --version`` and
``psguard policy check default`` in it as its non-root user; without a working daemon (``docker info`` fails) it
is skipped with the reason.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import psguard
from tests.support.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
K8S = ROOT / "integrations" / "kubernetes"
IMAGE = f"psguard:{psguard.__version__}"  # the tag the Dockerfile's header builds and the manifests run

SECRET_WORDS = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PRIVATE|CREDENTIAL|API_?KEY|ACCESS_KEY)", re.IGNORECASE)


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str  # upper case: FROM, RUN, COPY ...
    flags: dict[str, str]  # --from=build, --mount=... (the last one of each name)
    args: str  # the rest, continuation lines joined


def parse(text: str) -> list[Instruction]:
    """Dockerfile instructions: comments and blank lines dropped, backslash continuations joined, leading
    ``--flag=value`` options split off. Enough for the checks here (no heredocs, no parser directives)."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment line inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        line = " ".join(part.strip() for part in pending if part.strip())
        pending = []
        keyword, _, rest = line.partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        out.append(Instruction(start, keyword.upper(), flags, rest))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages(instructions: list[Instruction]) -> list[tuple[str | None, list[Instruction]]]:
    """(stage name, its instructions from its FROM on)."""
    out: list[tuple[str | None, list[Instruction]]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            out.append((name, [ins]))
        else:
            assert out or ins.keyword == "ARG", f"line {ins.line}: {ins.keyword} before the first FROM"
            if out:
                out[-1][1].append(ins)
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins, ``!`` re-includes (simplified: ``*``, ``**``
    and folder prefixes, which is what this repository's file uses)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        candidates = [path, *(str(p) for p in Path(path).parents if str(p) != ".")]
        matched = any(
            fnmatch.fnmatch(c, pat) or (pat.startswith("**/") and fnmatch.fnmatch(Path(c).name, pat[3:]))
            for c in candidates
        )
        if matched:
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _instructions() -> list[Instruction]:
    return parse(DOCKERFILE.read_text())


# ------------------------------------------------------------------------------------------ static checks
def test_the_parser_reads_continuations_flags_and_stages() -> None:
    text = "ARG X=1\n# c\nFROM a AS one\nRUN --mount=type=bind,from=one,target=/t \\\n    echo 1 \\\n  && echo 2\n"
    ins = parse(text + "FROM b\nUSER 10\n")
    assert [i.keyword for i in ins] == ["ARG", "FROM", "RUN", "FROM", "USER"]
    assert ins[2].flags == {"mount": "type=bind,from=one,target=/t"} and ins[2].args == "echo 1 && echo 2"
    assert [name for name, _ in stages(ins)] == ["one", None]


def test_multi_stage_the_runtime_takes_only_the_wheel_from_the_build_stage() -> None:
    parsed = stages(_instructions())
    assert len(parsed) >= 2, "a build stage for the wheel and a runtime stage"
    names = [name for name, _ in parsed]
    build_name, build = parsed[0]
    assert build_name == "build"
    assert any("python -m build --wheel" in i.args for i in build if i.keyword == "RUN")
    runtime = parsed[-1][1]
    # The runtime reaches into the build stage only for /dist (the wheel), by a bind mount or COPY --from.
    uses = [i for i in runtime if "from=build" in i.flags.get("mount", "") or i.flags.get("from") == "build"]
    assert uses, "the runtime stage installs the wheel built in the build stage"
    for ins in uses:
        assert "source=/dist" in ins.flags.get("mount", "") or ins.args.startswith("/dist"), ins
    assert not any("python -m build" in i.args for i in runtime), "no build tooling in the runtime stage"
    assert names[-1] in (None, "runtime")


def test_runtime_base_is_slim_python_311_and_tensorflow_is_a_build_choice() -> None:
    ins = _instructions()
    args = {i.args.split("=", 1)[0]: i.args.split("=", 1)[1] for i in ins if i.keyword == "ARG" and "=" in i.args}
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert parse_from(stages(ins)[-1][1][0]) == "${BASE_IMAGE}"
    assert args["TENSORFLOW"] == "cpu"
    run = next(i.args for i in ins if i.keyword == "RUN" and "TENSORFLOW" in i.args)
    for choice, extra in (("cpu", '"cpu"'), ("gpu", '"gpu"'), ("none", '""')):
        assert f"{choice}) extras={extra}" in run, choice
    assert "expected cpu, gpu or none" in run  # any other value fails the build


def parse_from(ins: Instruction) -> str:
    assert ins.keyword == "FROM"
    return ins.args.split()[0]


def test_the_image_ends_as_a_non_root_user() -> None:
    runtime = stages(_instructions())[-1][1]
    users = [i for i in runtime if i.keyword == "USER"]
    assert users, "the runtime stage sets USER"
    user = users[-1].args.split(":")[0]
    assert user not in ("0", "root", ""), user
    uid = re.fullmatch(r"\$\{(\w+)\}", user)
    if uid:  # USER ${PSGUARD_UID}: the ARG's default is a non-zero number
        default = next(i.args.split("=", 1)[1] for i in runtime if i.keyword == "ARG" and i.args.startswith(uid[1]))
        assert default.isdigit() and int(default) >= 1000, default
    created = [i for i in runtime if i.keyword == "RUN" and "useradd" in i.args]
    assert created and created[0].line < users[-1].line, "the user is created before USER switches to it"
    assert any(i.keyword == "RUN" and "psguard --version" in i.args for i in runtime if i.line > users[-1].line), (
        "the CLI is smoke-tested as the non-root user at build time"
    )


def test_nothing_fetched_by_add_and_no_secret_in_the_image() -> None:
    for ins in _instructions():
        assert ins.keyword != "ADD", f"line {ins.line}: ADD (use COPY; no URLs or archives fetched at build time)"
        assert "://" not in ins.args or ins.keyword in ("RUN",), ins  # no URL in COPY/FROM/ARG/ENV
        if ins.keyword in ("ARG", "ENV"):
            for name in re.findall(r"(\w+)=", ins.args) or [ins.args.split()[0]]:
                assert not SECRET_WORDS.search(name), f"line {ins.line}: {name}: a secret would be kept in the image"
        if ins.keyword == "COPY":
            for source in ins.args.split()[:-1]:
                assert not re.search(r"(\.pem|\.key|token|\.aws|\.env|id_rsa)", source), source
        if ins.keyword == "RUN":
            assert "--mount=type=secret" not in ins.args
            assert not re.search(r"curl|wget", ins.args), f"line {ins.line}: downloads outside pip"


def test_the_build_context_lets_in_exactly_what_the_dockerfile_copies() -> None:
    patterns = _dockerignore()
    copied = []
    for ins in _instructions():
        if ins.keyword == "COPY" and "from" not in ins.flags:
            copied += ins.args.split()[:-1]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not _ignored(source.rstrip("/"), patterns), f"{source} is copied but .dockerignore excludes it"
    # Everything else stays out: the venv, tests, chaos runs, git, caches inside copied folders.
    for path in (".venv", ".git", "tests", "chaos", "docs", "dist", "psguard/__pycache__", "psguard/x.pyc"):
        assert _ignored(path, patterns), f"{path} would be sent to the docker daemon"


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return found


def test_the_manifests_run_the_image_this_dockerfile_builds() -> None:
    header = DOCKERFILE.read_text()
    assert f"docker build -t {IMAGE} ." in header, f"the Dockerfile's header builds {IMAGE}"
    seen = 0
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for container in _containers(doc or {}):
                seen += 1
                assert container["image"] == IMAGE, f"{path.name}: {container['name']}: {container['image']}"
                # Scripts the manifests run from /app/examples exist where the Dockerfile copies them from.
                for arg in [*container.get("command", []), *container.get("args", [])]:
                    if arg.startswith("/app/examples/"):
                        assert (ROOT / "integrations" / "examples" / arg.removeprefix("/app/examples/")).is_file(), arg
    assert seen >= 4


# ------------------------------------------------------------------------------------------ a real build
def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    if info.returncode != 0:
        lines = [line for line in (info.stderr or info.stdout).splitlines() if line.strip()]
        return f"docker info failed: {lines[-1] if lines else info.returncode}"
    return None


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_image_builds_and_runs_psguard_as_non_root() -> None:
    reason = _docker_unavailable()
    if reason is not None:
        pytest.skip(f"no working docker daemon: {reason}")
    tag = f"psguard-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(["docker", "build", "-t", tag, "."], cwd=ROOT, capture_output=True, text=True, timeout=3500)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    try:

        def run(*args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
            cmd = ["docker", "run", "--rm", *(["--entrypoint", entrypoint] if entrypoint else []), tag, *args]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

        uid = run("-u", entrypoint="id")
        assert uid.returncode == 0 and uid.stdout.strip() not in ("", "0"), uid
        version = run("--version")
        assert version.returncode == 0, version.stderr
        assert f"psguard {psguard.__version__}" in version.stdout and "TensorFlow 2." in version.stdout
        check = run("policy", "check", "default")
        assert check.returncode == 0, check.stdout + check.stderr
        size = subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Size}}", tag], capture_output=True, text=True, timeout=60
        )
        print(f"image {tag}: {int(size.stdout.strip()) / 1e6:.0f} MB, uid {uid.stdout.strip()}")
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)
