#!/usr/bin/env bash
# Regenerate the Python modules from the .proto files (needs grpcio-tools).
# The files are compiled under their import path radixmesh/proto/ so the generated
# modules import each other as radixmesh.proto.*.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/radixmesh"
ln -s "$here" "$root/radixmesh/proto"
cd "$root"
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
    radixmesh/proto/worker.proto radixmesh/proto/mesh.proto radixmesh/proto/generate.proto \
    radixmesh/proto/cache.proto
rm -f "$here/mesh_pb2_grpc.py"
