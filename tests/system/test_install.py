"""psguard as users install it: the wheel's contents, TensorFlow as an optional dependency, ``psguard --version``.

The slow tests build the wheel (``python -m build``) and use it from outside the repository; the ``compat`` one
runs the same checks in a venv holding the lowest versions psguard declares (``make test-compat`` builds it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from psguard import cli
from psguard.dependencies import tensorflow_version, versions
from psguard.policy.files import preset_names
from tests.support.paths import ROOT

# Run from outside the repository by the installed-wheel tests: save, restore and verify a tf.Module.
SMOKE = """
import sys, tensorflow as tf, psguard
assert "site-packages" in psguard.__file__ or sys.argv[2] in psguard.__file__, psguard.__file__
class M(tf.Module):
    def __init__(self):
        self.emb = tf.Variable(tf.random.uniform([100, 8]))
        self.step = tf.Variable(0, dtype=tf.int64)
m = M()
m.step.assign(7)
with psguard.CheckpointManager(tf.train.Checkpoint(model=m), sys.argv[1], step_counter=m.step) as mgr:
    mgr.save().result(timeout=60)
want = m.emb.numpy().copy()
m.emb.assign(tf.zeros([100, 8]))
with psguard.CheckpointManager(tf.train.Checkpoint(model=m), sys.argv[1], step_counter=m.step) as mgr:
    mgr.restore_or_initialize()
assert (m.emb.numpy() == want).all() and int(m.step) == 7
print("roundtrip ok", tf.__version__)
"""

# The zero-copy restore op under the installed TensorFlow: built (``psguard build-op``; the build is keyed by
# TensorFlow's library, so an older TensorFlow gets its own), loaded, and a mapped bundle bit-exact; the C row
# digest built from the installed source and the same as numpy's under the oldest numpy.
OP_SMOKE = """
import os, sys, numpy as np, tensorflow as tf
from psguard.handoff import mapped
from psguard.handoff.tensor_bundle import BUNDLE_KEY, write_bundle
mapped.build()
fn = mapped.map_op()
assert fn is not None, "built, not loadable"
value = np.random.default_rng(1).standard_normal((4096, 8)).astype(np.float32)
prefix = os.path.join(sys.argv[1], "b")
write_bundle(prefix, value)
var = tf.Variable(tf.zeros(value.shape))
var.assign(fn(prefix, dtype=tf.float32, key=BUNDLE_KEY, verify=True))
assert var.numpy().tobytes() == value.tobytes()
from psguard.handoff import native
from psguard.agent.tiers.copy_frames import _numpy_digest, rows_digest
native.build_digest()
assert native.digest_function() is not None, "the C digest built, not loadable"
ids = np.arange(3, 4099)
assert rows_digest(value, ids) == _numpy_digest(value.view(np.uint8).reshape(4096, -1), ids)
print("op ok", tf.__version__)
"""


def test_version_names_psguard_tensorflow_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.splitlines()
    tf = tensorflow_version()
    assert tf is not None
    assert out == [
        f"psguard {versions()['psguard']}",
        f"TensorFlow {tf[0]} ({tf[1]})",
        f"Python {versions()['python']}",
    ]


def test_version_without_tensorflow_names_the_extras(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("psguard.dependencies.TENSORFLOW_DISTRIBUTIONS", ("no-such-distribution",))
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("TensorFlow: none. TensorFlow is not installed: pip install 'psguard[cpu]'")


def test_without_tensorflow_the_manager_names_the_extras_and_the_cli_still_runs(tmp_path: Path) -> None:
    code = """
import sys
sys.modules["tensorflow"] = None  # as in an image without TensorFlow
import psguard
from psguard import cli
try:
    psguard.CheckpointManager(None, sys.argv[1])
except psguard.MissingDependencyError as e:
    print("refused:", e)
assert cli.main(["policy", "check", "default"]) == 0
"""
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120, check=True
    )
    assert "refused: TensorFlow is not installed: pip install 'psguard[cpu]' in a CPU image" in done.stdout
    assert "'psguard[gpu]'" in done.stdout and "default: ok" in done.stdout
    assert not (tmp_path / "ckpt").exists()


def test_a_missing_optional_dependency_is_one_line_naming_its_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib", "matplotlib.backends", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["policy", "simulate", "default", "--mtbf", "6h", "--stall", "0.5s", "--persist", "20s", "--duration", "1d"]
    assert cli.main([*argv, "--plot", str(tmp_path / "p.png")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "psguard: error: matplotlib is not installed: pip install 'psguard[plot]'"


# ------------------------------------------------------------------------------------------- the wheel
@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "-o", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (whl,) = out.glob("psguard-*.whl")
    return whl


@pytest.mark.slow
def test_the_wheel_holds_the_presets_the_type_marker_and_every_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"psguard/policy/presets/{p}.yaml" for p in preset_names()} <= names
    assert "psguard/py.typed" in names
    assert {"psguard/handoff/map_bundle.cc", "psguard/handoff/rows_digest.c"} <= names  # what build-op compiles
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "psguard").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    hard = [r for r in requires if "extra ==" not in r]
    assert not [r for r in hard if "tensorflow" in r or "matplotlib" in r or "watchdog" in r], hard
    assert 'Requires-Dist: tensorflow-cpu<2.22,>=2.16; extra == "cpu"' in requires
    assert 'Requires-Dist: tensorflow<2.22,>=2.16; extra == "gpu"' in requires


@pytest.fixture
def installed(wheel: Path, tmp_path: Path) -> Iterator[Path]:
    """The wheel installed (without dependencies: this venv has them) into a folder of its own."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    yield target


def smoke(python: str, bin_dir: Path, env: dict[str, str], work: Path, site: str) -> None:
    """``psguard --version``, ``psguard policy check default`` and a save/restore, run from ``work``."""
    psguard = str(bin_dir / "psguard")
    version = subprocess.run([psguard, "--version"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("psguard ") and "\nTensorFlow " in version.stdout
    check = subprocess.run(
        [psguard, "policy", "check", "default"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0 and "default: ok" in check.stdout, check.stderr
    done = subprocess.run(
        [python, "-c", SMOKE, str(work / "ckpt"), site], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert "roundtrip ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_the_installed_wheel_works_outside_the_repository(installed: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    work = tmp_path / "job"
    work.mkdir()
    smoke(sys.executable, installed / "bin", env, work, str(installed))


@pytest.mark.slow
@pytest.mark.compat
def test_the_wheel_under_the_oldest_declared_versions(wheel: Path, tmp_path: Path) -> None:
    """``make test-compat``: a venv with tests/compat/lowest.txt (TensorFlow 2.16 and the lowest fsspec, s3fs,
    numpy, ...) gets the wheel with pip's ordinary resolution, constrained to those versions."""
    python = os.environ.get("PSGUARD_COMPAT_PYTHON")
    if not python:
        pytest.skip(
            "set PSGUARD_COMPAT_PYTHON to a venv's python built from tests/compat/lowest.txt (make test-compat)"
        )
    lowest = ROOT / "tests" / "compat" / "lowest.txt"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", str(lowest), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "job"
    work.mkdir()
    smoke(python, Path(python).parent, env, work, "site-packages")
    tf = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('tensorflow-cpu'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert tf.stdout.startswith("2.16.")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    op_env = {**env, "PSGUARD_CACHE": str(cache)}
    op = subprocess.run([python, "-c", OP_SMOKE, str(work)], capture_output=True, text=True, env=op_env, timeout=600)
    assert op.returncode == 0 and "op ok 2.16." in op.stdout, op.stderr[-4000:]
