# Every target does its own set-up on a fresh machine: the venv is (re)built when pyproject.toml or this file changes.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-compat dist lint typecheck bench clean hdfs-runtime prometheus-runtime map-op chaos chaos-smoke soak explore

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel
	$(BIN)/python -m pip install -q -e '.[dev]'
	# tf-keras depends on the full `tensorflow` wheel; tensorflow-cpu already provides it, so skip its deps.
	# Its minor version must be TensorFlow's.
	$(BIN)/python -m pip install -q --no-deps "tf-keras==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu").rsplit(".", 1)[0])').*"
	# Libraries whose job styles tests/cluster/e2e/test_job_styles.py runs: Model Garden's orbit (in tf-models-no-deps)
	# and TensorFlow Recommenders. Both declare the full `tensorflow` wheel (tf-models-no-deps some 25 more: opencv,
	# pandas, kaggle, ...), yet orbit and tensorflow_recommenders import only TensorFlow, tf_keras, absl-py and numpy,
	# which are here: skip their deps.
	$(BIN)/python -m pip install -q --no-deps "tf-models-no-deps==2.19.*" "tensorflow-recommenders==0.7.*"
	touch $(STAMP)

# A real HDFS for the storage tests: Hadoop jars cached under ~/.cache/psguard/hadoop (and Debian's jersey1).
# Idempotent and quick once done.
hdfs-runtime: $(STAMP)
	$(BIN)/python -m psguard.testbed.hdfs prepare

# psguard's zero-copy restore op (psguard/handoff/map_bundle.cc) compiled for this TensorFlow into
# ~/.cache/psguard/ops, once (a few seconds): without it restores read every shard, as they did before. The same
# command builds the peer copies' row digest in C (psguard/handoff/rows_digest.c; numpy's serves without it).
map-op: $(STAMP)
	$(BIN)/python -m psguard.handoff.mapped

# Debian's Prometheus binaries (promtool tests the shipped alerts), unpacked into ~/.cache/psguard/prometheus once.
prometheus-runtime: $(STAMP)
	$(BIN)/python -m psguard.testbed.prometheus prepare

demo: $(STAMP)
	$(BIN)/psguard demo

lint: $(STAMP)
	$(BIN)/ruff check psguard tests
	$(BIN)/ruff format --check psguard tests

typecheck: $(STAMP)
	$(BIN)/mypy

# Two test processes: the tests that start TensorFlow clusters (tests/cluster/; tests/conftest.py groups them) run
# one at a time in one of them, everything else in the other. Tests marked `serial` (they judge time or load) run afterwards, alone.
test: lint typecheck hdfs-runtime prometheus-runtime map-op
	$(BIN)/python -m pytest -q -m 'not compat and not serial' -n 2 --dist loadgroup --durations=60
	$(BIN)/python -m pytest -q -m 'serial and not compat' --durations=10

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow' -x

# sdist and wheel in dist/ (the presets are package data inside the wheel).
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build -o dist .

# The wheel in a venv holding the lowest versions pyproject.toml declares (TensorFlow 2.16, ...): about 600 MB
# downloaded once into $(COMPAT_VENV), then a few minutes. Not part of `make test`.
COMPAT_VENV ?= /tmp/psguard-compat-venv
test-compat: $(STAMP)
	test -x $(COMPAT_VENV)/bin/python || $(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q -r tests/compat/lowest.txt
	PSGUARD_COMPAT_PYTHON=$(COMPAT_VENV)/bin/python $(BIN)/python -m pytest -q -m compat tests/system/test_install.py

# Every scenario in chaos/ on a real local cluster (one after another; each stops itself within its time limit
# and cleans up). Runs, histories and reports in chaos-runs/; the fault-free reference run is shared.
CHAOS_SEED ?= 0
chaos: $(STAMP) hdfs-runtime map-op
	@status=0; for s in $(filter-out chaos/soak-%,$(wildcard chaos/*.yaml)); do \
		$(BIN)/psguard chaos run $$s --seed $(CHAOS_SEED) --reference-dir chaos-runs || status=1; \
	done; exit $$status

# A week of faults in an hour on 256 MB of state (issue 26); CI runs soak-ci for 5 minutes. A fresh seed each
# time (printed; SOAK_SEED=S replays one).
SOAK_DURATION ?= 1h
soak: $(STAMP) map-op
	$(BIN)/psguard chaos soak chaos/soak-256mb.yaml --duration $(SOAK_DURATION) $(if $(SOAK_SEED),--seed $(SOAK_SEED))

# Drawn chaos cases (issue 46): settings and faults drawn from a seed, each case run on psguard and on plain TF and
# judged side by side (not-worse-than-tf), failing cases shrunk. A fresh seed each time (printed; EXPLORE_SEED=S
# replays the exploration; `psguard chaos explore --seed S --case I` one case). Summary in chaos-runs/explore-seedS/.
EXPLORE_BUDGET ?= 1h
explore: $(STAMP) hdfs-runtime map-op
	$(BIN)/psguard chaos explore --space full --budget $(EXPLORE_BUDGET) --shrink $(if $(EXPLORE_SEED),--seed $(EXPLORE_SEED))

# The CI smoke set (kill-ps, kill-worker, corrupt-chunk): 8-12 minutes on 2 cores.
chaos-smoke: $(STAMP) map-op
	$(BIN)/python -m pytest -q tests/cluster/e2e/test_chaos_smoke.py

bench: $(STAMP)
	$(BIN)/psguard bench store

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache dist build
