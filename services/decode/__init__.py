"""decode worker: pulls KV over UCX into a paged cache and generates with continuous batching.

A request's life here: claimed (handle claimed at the kvbroker, blocks
reserved) -> transfer (UCX pull into the blocks) -> waiting -> running (joins
the batch at the next step) -> finished / aborted (blocks freed).
"""
