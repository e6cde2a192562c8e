"""Generated gRPC/protobuf stubs for distserve.v1 (scripts/gen_protos.sh); do not edit."""
