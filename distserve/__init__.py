"""distserve: disaggregated prefill/decode LLM serving.

Shared code used by every service: config, gRPC plumbing, registry, tracing,
the engine (model runner, paged KV cache, sampler) and the UCX transfer layer.
"""

import os

# gRPC's fork handlers (on by default in grpcio) can deadlock fork() itself when a process that holds
# gRPC channels starts a child (grpc/grpc#37259: the launcher's supervisor restarting a worker hung
# while the test process streamed), and can leave the child's poller on closed descriptors
# ("epoll_wait error: Bad file descriptor", #13873). Every child we start execs at once, which is the
# case gRPC documents this switch for. Set before any distserve module imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
