"""Moving KV caches between workers. KV bytes go over UCX only, never gRPC or Redis."""
