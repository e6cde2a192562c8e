"""The OpenAI-compatible HTTP gateway: /v1/completions and /v1/chat/completions over the router.

It runs in its own process (`python -m services.router.gateway`) and speaks
only gRPC to the router. A request's life here: authenticated -> parsed and
type-checked (openai_protocol) -> one RouterService.Generate call -> router
messages rendered as an OpenAI response, or as SSE chunks while they arrive
(answers). Range checks stay the router's; its "<field>: <message>" errors
come back as 400s naming the client's field (errors). A client that goes away
cancels the gRPC call, so the router cancels the workers and KV is freed.
"""
