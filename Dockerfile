# The psguard image: the agent, the CLI and TensorFlow on Python 3.11, with the examples of integrations/examples
# under /app/examples. It is the image integrations/kubernetes/ runs (tests/system/test_dockerfile.py checks the names
# agree); a training image adds its own script on top (FROM psguard:0.1.0, COPY train.py /app/).
#
#   docker build -t psguard:0.1.0 .                              # tensorflow-cpu (psguard[cpu])
#   docker build --build-arg TENSORFLOW=gpu -t psguard:0.1.0-gpu .
#       # the full `tensorflow` wheel (psguard[gpu]); give a BASE_IMAGE with CUDA and Python >= 3.11
#   docker build --build-arg BASE_IMAGE=tensorflow/tensorflow:2.19.0-gpu --build-arg TENSORFLOW=none \
#       -t psguard:0.1.0-tf2.19-gpu .
#       # the base image's own TensorFlow (2.16-2.21) is kept as it is: psguard never installs a second one
#
# Build arguments: BASE_IMAGE (the runtime's base, default python:3.11-slim), TENSORFLOW (cpu | gpu | none),
# PSGUARD_EXTRAS (more extras, comma-separated, default "watch": spool and policy files noticed by events),
# TF_KERAS (1: tf-keras matching the TensorFlow minor, installed without its dependencies, as the examples and
# model.fit under ParameterServerStrategy need; 0: none), PSGUARD_UID (the non-root user's uid, default 10001),
# MAP_OP (1: compile psguard's zero-copy restore op into the image, the default; 0: not).
#
# The build needs PyPI (the wheel's dependencies); nothing else is downloaded. No secret goes into the image:
# S3 credentials, the agents' token and TLS files are mounted at run time (see integrations/kubernetes/).

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------- build: the wheel
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
RUN python -m pip install "build>=1"
WORKDIR /src
# Only what the wheel is built from (the presets are package data under psguard/policy/presets).
COPY pyproject.toml README.md ./
COPY psguard/ psguard/
RUN python -m build --wheel --outdir /dist . && ls -l /dist

# ---------------------------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
ARG TENSORFLOW=cpu
ARG PSGUARD_EXTRAS=watch
ARG TF_KERAS=1
ARG PSGUARD_UID=10001
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    TF_CPP_MIN_LOG_LEVEL=1

# The wheel comes from the build stage through a bind mount: it is installed, not kept in a layer.
RUN --mount=type=bind,from=build,source=/dist,target=/tmp/dist \
    set -eu; \
    case "$TENSORFLOW" in \
      cpu) extras="cpu" ;; \
      gpu) extras="gpu" ;; \
      none) extras="" ;; \
      *) echo "TENSORFLOW=$TENSORFLOW: expected cpu, gpu or none" >&2; exit 2 ;; \
    esac; \
    extras="$(printf '%s,%s' "$extras" "$PSGUARD_EXTRAS" | sed 's/^,*//; s/,*$//')"; \
    wheel="$(ls /tmp/dist/psguard-*.whl)"; \
    if [ -n "$extras" ]; then spec="$wheel[$extras]"; else spec="$wheel"; fi; \
    python3 -m pip install "$spec"; \
    tf="$(python3 -c "import importlib.metadata as m; v = [d.version for d in m.distributions() if (d.metadata['Name'] or '').lower().replace('_', '-') in ('tensorflow', 'tensorflow-cpu')]; print(v[0] if v else '')")"; \
    if [ -z "$tf" ]; then echo "no TensorFlow in the image: TENSORFLOW=none needs a BASE_IMAGE that has one" >&2; exit 2; fi; \
    python3 -m pip check; \
    if [ "$TF_KERAS" = 1 ]; then python3 -m pip install --no-deps "tf-keras==${tf%.*}.*"; fi; \
    psguard --version

COPY integrations/examples/ /app/examples/

# A non-root user with a fixed uid (runAsNonRoot can check it). /dev/shm (the spool and the agents' state)
# is writable by every user; the working directory is its home.
RUN useradd --uid "$PSGUARD_UID" --user-group --create-home --home-dir /home/psguard --shell /usr/sbin/nologin psguard
# psguard's zero-copy restore op, compiled for the image's TensorFlow into the user's cache (psguard build-op), with a
# compiler that leaves the image in the same layer. MAP_OP=0 skips it (restores then read every shard, as before).
ARG MAP_OP=1
RUN set -eu; \
    if [ "$MAP_OP" = 1 ]; then \
      apt-get update; apt-get install -y --no-install-recommends g++; \
      su psguard -s /bin/sh -c "psguard build-op" || echo "psguard build-op failed: restores will read every shard" >&2; \
      apt-get purge -y --auto-remove g++; rm -rf /var/lib/apt/lists/*; \
    fi
USER ${PSGUARD_UID}:${PSGUARD_UID}
WORKDIR /home/psguard
RUN psguard --version && psguard policy check default

ENTRYPOINT ["psguard"]
CMD ["--help"]
