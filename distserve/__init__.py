"""distserve: disaggregated prefill/decode LLM serving.

Shared code used by every service: config, gRPC plumbing, registry, tracing,
the engine (model runner, paged KV cache, sampler) and the UCX transfer layer.
"""

__version__ = "0.1.0"
