"""The router's gRPC API is discoverable by reflection (what grpcurl uses): services, methods and the
request fields of issue 10's API."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def test_reflection_lists_the_router_api(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "distserve.v1.RouterService" in database.get_services()
        pool = DescriptorPool(database)
        methods = {m.name for m in pool.FindServiceByName("distserve.v1.RouterService").methods}
        request = {f.name for f in pool.FindMessageTypeByName("distserve.v1.GenerateRequest").fields}
        sampling = {f.name for f in pool.FindMessageTypeByName("distserve.v1.SamplingParams").fields}
    assert methods == {"Generate", "GenerateMux", "Tokenize", "Detokenize"}
    assert {"n", "best_of", "echo", "user", "sampling"} <= request
    assert {"logprobs", "prompt_logprobs", "structured_output"} <= sampling
