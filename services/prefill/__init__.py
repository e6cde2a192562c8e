"""prefill worker: batches prompts, produces the first token and holds the KV for decode.

A request's life here: waiting (queue, packed up to max_batch_tokens, long prompts in chunks) ->
forward (one or more packed batches) -> held (KV buffer registered with the kvbroker) ->
freed (decode's UCX ack, a broker release, or the lease expiring).
"""
