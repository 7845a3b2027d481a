# One image for the kvpilot engine, operator and gateway (entrypoint `kvpilot`):
#   engine pods run `kvpilot serve MODEL ...`, the operator `kvpilot operator`, the gateway
#   `kvpilot gateway`. Dependencies install from scripts/constraints.txt, the same pins CI installs.
#
#   docker build -t REGISTRY/kvpilot:TAG .                 # on the public Python base
#   scripts/build-image.sh                                 # here: a Debian base made by mmdebstrap, podman
#
# BASE_IMAGE is any Debian bookworm image with python3 (3.11) and python3-venv.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm

# The dependencies alone, from pyproject.toml and the pins: this layer is rebuilt only when they
# change, not when kvpilot's code does.
FROM ${BASE_IMAGE} AS deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python3 -m venv /opt/kvpilot
COPY pyproject.toml ./
COPY scripts/constraints.txt scripts/
RUN python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + [d for extra in ("engine", "operator", "gateway") \
for d in p["optional-dependencies"][extra]]))' > requirements.txt \
    && /opt/kvpilot/bin/pip install -c scripts/constraints.txt -r requirements.txt \
    && find /opt/kvpilot -name '__pycache__' -type d -prune -exec rm -rf {} +

# kvpilot itself, installed as a wheel (no -e) for the same virtualenv, under /stage: its files alone.
FROM deps AS build
COPY setup.py README.md ./
COPY kvpilot/ kvpilot/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
COPY gateway/ gateway/
COPY localcluster/ localcluster/
RUN /opt/kvpilot/bin/pip install --no-deps --no-warn-script-location --root /stage . \
    && find /stage -name '__pycache__' -type d -prune -exec rm -rf {} +

FROM ${BASE_IMAGE}
# A C compiler at run time, not a build tool: the CPU kernels (kernels/cpu_*.c) are compiled for
# the machine and the model's shapes when an engine starts, and Triton builds its GPU launchers with
# one. Unpinned: the base image fixes the Debian release, whose security updates we want.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric non-root user: the operator's engine pods set runAsUser 10001 to match.
RUN groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp/home --no-create-home \
       --shell /usr/sbin/nologin kvpilot
# Two copies: the dependencies' large layer stays cached while only kvpilot's files change.
COPY --from=deps /opt/kvpilot /opt/kvpilot
COPY --from=build /stage/ /
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
