# syntax=docker/dockerfile:1
# mnn-rollout: one image for the operator (`mnn-rollout operator`) and the runtime pods it creates
# (`mnn-rollout serve --configmap NS/NAME`), with the example models baked in under
# /opt/mnn-rollout/examples (examples/*.yaml point at file:///opt/mnn-rollout/examples/v1.mnn ...).
#
#   docker build -t ghcr.io/mnn-rollout/mnn-rollout:0.1.0 .
#
# Runs as the numeric non-root user 65532 (the UID the operator gives runtime pods) and writes
# only to /tmp, so it works with readOnlyRootFilesystem: true.

# --- builder: compilers, the package installed into a venv ---------------------------------------
FROM python:3.11.11-slim-bookworm AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common/ common/
COPY runtime/ runtime/
COPY operator/ operator/
# A regular (non-editable) install: the final stage needs only /opt/venv, not /src.
RUN pip install --upgrade pip setuptools wheel \
 && pip install . \
 && python -m compileall -q /opt/venv/lib \
 && mnn-rollout --help >/dev/null

# --- examples: build the example models (ONNX -> MNN needs the `dev` extra: onnx) ----------------
FROM builder AS examples
RUN pip install ".[dev]" \
 && mnn-rollout examples /opt/mnn-rollout/examples

# --- final: the same slim base, no compilers, the venv and the models only -------------------------
FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="mnn-rollout" \
      org.opencontainers.image.description="Progressive canary rollouts of MNN models: operator and runtime" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp
COPY --from=builder /opt/venv /opt/venv
COPY --from=examples /opt/mnn-rollout/examples/*.mnn /opt/mnn-rollout/examples/SHA256SUMS /opt/mnn-rollout/examples/
USER 65532:65532
WORKDIR /tmp
# 8080 runtime (OIP v2 + /metrics), 8090 operator /metrics, 8091 kopf liveness, 8092 Alertmanager webhook
EXPOSE 8080 8090 8091 8092
ENTRYPOINT ["mnn-rollout"]
CMD ["--help"]
