"""router: the public gRPC API. Validates, picks a prefill and a decode worker, streams tokens.

A request's life here: validated -> routed (least-loaded prefill and decode
from the live registry) -> prefill (first token streamed at once) -> decode
(tokens streamed, stop strings applied) -> finished (usage and timings).
"""
