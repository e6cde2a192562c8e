#!/usr/bin/env bash
# Generates the Python stubs for protos/distserve/v1 into distserve/v1 (the one output place).
# CI runs this and fails when the committed stubs differ from the result.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f distserve/v1/*_pb2*.py distserve/v1/*_pb2*.pyi
python -m grpc_tools.protoc -I protos \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/distserve/v1/*.proto
echo '"""Generated gRPC/protobuf stubs for distserve.v1 (scripts/gen_protos.sh); do not edit."""' > distserve/v1/__init__.py
