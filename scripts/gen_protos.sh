#!/usr/bin/env bash
# Generates the Python stubs for protos/distserve/v1 into distserve/v1 (the one output place).
# CI runs this and fails when the committed stubs differ from the result.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f distserve/v1/*_pb2*.py distserve/v1/*_pb2*.pyi
python -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/distserve/v1/*.proto
# The stubs refuse a grpcio older than the grpcio-tools that wrote them. The lock pins grpcio-tools, but
# pyproject.toml allows any grpcio 1.85.x (patch releases change no generated code), so the stubs ask for
# the release line's first version, and a patch release of grpcio-tools leaves them unchanged.
sed -i -E "s/^GRPC_GENERATED_VERSION = '([0-9]+\.[0-9]+)\.[0-9]+'/GRPC_GENERATED_VERSION = '\1.0'/" \
  distserve/v1/*_pb2_grpc.py
echo '"""Generated gRPC/protobuf stubs for distserve.v1 (scripts/gen_protos.sh); do not edit."""' > distserve/v1/__init__.py
