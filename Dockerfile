# One image for the kvpilot engine and operator (entrypoint `kvpilot`):
#   engine pods run `kvpilot serve MODEL ...`, the operator runs `kvpilot operator`.
# Dependencies install from scripts/constraints.txt, the same pins CI installs.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kvpilot
COPY pyproject.toml setup.py README.md ./
COPY scripts/constraints.txt scripts/
COPY kvpilot/ kvpilot/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
COPY gateway/ gateway/
COPY localcluster/ localcluster/
RUN /opt/kvpilot/bin/pip install --no-cache-dir -c scripts/constraints.txt ".[engine,operator]" \
    && find /opt/kvpilot -name '__pycache__' -type d -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
# A C compiler at run time: Triton builds its GPU launchers with one, and the CPU decode-attention
# kernel (kernels/cpu_paged_decode.c) is compiled for the machine it runs on. Unpinned: the
# pinned base image tag fixes the Debian release, whose security updates we want.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric non-root user: the operator's engine pods set runAsUser 10001 to match.
RUN groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp/home --no-create-home \
       --shell /usr/sbin/nologin kvpilot
COPY --from=build /opt/kvpilot /opt/kvpilot
# Caches go under /tmp: pods run with a read-only root filesystem and an emptyDir at /tmp.
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp/home \
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/triton
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 8080
ENTRYPOINT ["kvpilot"]
CMD ["--help"]
