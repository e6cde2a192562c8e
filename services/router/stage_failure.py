"""Worker failures as the router sees them: which stage failed, and whether another worker may make
up for it (request migration) or the client must hear of it."""

from __future__ import annotations

import grpc

from distserve.registry import WorkerRecord

# Worker failures another worker can make up for. UNAVAILABLE: the worker is unreachable or died.
# Decode only: DATA_LOSS: the KV's owner could not deliver it (died, stalled past the transfer
# timeout, refused, or its bytes failed their checksum); ABORTED: the claim failed or the worker
# preempted the request (its cache filled up); NOT_FOUND: the handle is gone; DEADLINE_EXCEEDED:
# the router's idle watchdog found the worker silent (stalled). Colocated: a worker that died moves
# its requests to a prefill/decode pair (services.router.server). Workers use these codes for nothing else.
RETRYABLE = {"prefill": {grpc.StatusCode.UNAVAILABLE},
             "decode": {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
                        grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED},
             "colocated": {grpc.StatusCode.UNAVAILABLE}}


class StageFailed(Exception):
    """A worker call failed; `retryable` when another worker may succeed where this one did not."""

    def __init__(self, code: grpc.StatusCode, details: str, worker: WorkerRecord, stage: str):
        super().__init__(f"{stage} worker {worker.worker_id}: {details}")
        self.code, self.details, self.worker, self.stage = code, details, worker, stage
        self.retryable = code in RETRYABLE.get(stage, ())

    @classmethod
    def of(cls, error: grpc.aio.AioRpcError, worker: WorkerRecord, stage: str) -> "StageFailed":
        return cls(error.code(), error.details() or "", worker, stage)
