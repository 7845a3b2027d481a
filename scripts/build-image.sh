#!/usr/bin/env bash
# Builds the kvpilot image (the Dockerfile the chart deploys) on this machine, with no registry:
#   1. podman, buildah, mmdebstrap and runc from Debian's packages (installed with apt as root);
#   2. a Debian bookworm base (python3 3.11, python3-venv, ca-certificates) made by mmdebstrap from
#      Debian's archive and imported as localhost/kvpilot-base:bookworm, once per machine;
#   3. the image, from the same Dockerfile with BASE_IMAGE set to that base, tagged
#      localhost/kvpilot:<hash of its inputs>; an image of the same inputs is reused as it is.
# Prints the image's name on stdout (everything else goes to stderr), e.g.
#   IMAGE=$(scripts/build-image.sh) && podman run --rm "$IMAGE" --version
# podman runs with the containers.conf this script writes ($KVPILOT_CACHE/podman/containers.conf:
# runc, cgroupfs, no default ulimits; crun and ulimit changes are refused on this machine class);
# export CONTAINERS_CONF=<that file> to use podman by hand. Nothing else of the machine is changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

KVPILOT_CACHE="${KVPILOT_CACHE:-$HOME/.cache/kvpilot}"
BASE="localhost/kvpilot-base:bookworm"
REPOSITORY="localhost/kvpilot"
say() { echo "build-image: $*" >&2; }
fail() { echo "build-image: $1 failed; $2" >&2; exit 1; }

if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v runc >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        say "installing podman, buildah, mmdebstrap, runc (apt-get)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            podman buildah mmdebstrap runc uidmap >/dev/null; } \
            || fail "installing podman" "run: apt-get update && apt-get install podman buildah mmdebstrap runc uidmap"
    else
        fail "finding podman" "install it first: sudo apt-get install podman buildah mmdebstrap runc uidmap"
    fi
fi

mkdir -p "$KVPILOT_CACHE/podman"
export CONTAINERS_CONF="$KVPILOT_CACHE/podman/containers.conf"
cat >"$CONTAINERS_CONF" <<'CONF'
# Written by scripts/build-image.sh: crun and per-container ulimits are refused on this machine class.
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
podman info >/dev/null 2>"$KVPILOT_CACHE/podman/info.err" \
    || fail "podman info" "$(tail -1 "$KVPILOT_CACHE/podman/info.err"); run: CONTAINERS_CONF=$CONTAINERS_CONF podman info"

if ! podman image exists "$BASE"; then
    say "building the base $BASE with mmdebstrap (about a minute)"
    rootfs="$(mktemp -d)/rootfs.tar"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" >&2 \
        || fail "the base build" "run: mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm rootfs.tar"
    podman import --quiet "$rootfs" "$BASE" >/dev/null || fail "importing the base" "run: podman import $rootfs $BASE"
    rm -rf "$(dirname "$rootfs")"
fi

# The inputs: what the Dockerfile copies (.dockerignore's list), the Dockerfile, the base.
CONTEXT=(pyproject.toml setup.py README.md scripts/constraints.txt kvpilot engine kernels operator gateway localcluster)
inputs="$( { podman image inspect --format '{{.Id}}' "$BASE"; sha256sum Dockerfile .dockerignore;
    find "${CONTEXT[@]}" -type f -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path 'localcluster/go/*' \
        -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-12)"
IMAGE="$REPOSITORY:$inputs"
if podman image exists "$IMAGE"; then
    say "$IMAGE is up to date (same inputs)"
else
    say "building $IMAGE (the first build downloads the Python dependencies, torch included: minutes)"
    # The host's trust store and pip settings go to the RUN steps only (a proxy's CA; nothing stays
    # in the image), as bind mounts.
    mounts=()
    for file in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
        [[ -f $file ]] && mounts+=(--volume "$file:$file:ro")
    done
    started=$SECONDS
    podman build --network=host --layers "${mounts[@]}" --build-arg "BASE_IMAGE=$BASE" -t "$IMAGE" . >&2 \
        || fail "podman build" "run: CONTAINERS_CONF=$CONTAINERS_CONF podman build --network=host --build-arg BASE_IMAGE=$BASE ."
    say "built in $((SECONDS - started)) s"
fi
podman tag "$IMAGE" "$REPOSITORY:latest"
size="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
say "$IMAGE: $((size / 1000000)) MB"
echo "$IMAGE"
