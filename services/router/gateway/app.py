"""The aiohttp application: routes, API-key check, request ids, and errors as OpenAI error objects.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}],
POST /tokenize and /detokenize (vLLM's; tokenizer_endpoints), GET /metrics (these need
the API key when one is configured), GET /health (ready to serve: routers and workers), GET /live (the
process answers: liveness probes), GET /version.
Run with handler_cancellation=True: a client that disconnects cancels its
handler, whose `finally` cancels the router call.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import prometheus_client
from aiohttp import web

import distserve
from distserve import tracing
from distserve.metrics import GatewayMetrics
from services.router.gateway.answers import streamed_answer, whole_answer
from services.router.gateway.chat_output import ChatOutput, ChatOutputFactory
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.config import GatewayConfig
from services.router.gateway.errors import ApiError, bad_request, internal_error
from services.router.gateway.json_fields import parse_json_object
from services.router.gateway.limits import TokenBuckets, body_deadline_middleware, rate_limit_middleware
from services.router.gateway.openai_protocol import (
    ApiRequest,
    Endpoint,
    check_model,
    parse_chat,
    parse_completion,
    requested_model,
)
from services.router.gateway.responses import ID_PREFIX, AnswerMeta
from services.router.gateway.reasoning import ReasoningParser
from services.router.gateway.router_client import RouterClient
from services.router.gateway.tokenizer_endpoints import PATHS as TOKENIZER_PATHS
from services.router.gateway.tokenizer_endpoints import TokenizerEndpoints
from services.router.gateway.tools import parser_for_template
from services.router.validation import THREAD_TOKENIZE_CHARS, prompt_size_problem

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 128  # the router's limit (services.router.validation)
_REQUEST_ID = web.RequestKey("request_id", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """The handlers, with the router client they share (opened and closed by `lifespan`)."""

    def __init__(self, config: GatewayConfig, template: ChatTemplate, served_model_name: str,
                 metrics: GatewayMetrics):
        self._config = config
        self._metrics = metrics
        self._template = template
        self._token_text = functools.lru_cache(maxsize=65536)(lambda token: template.tokenizer.decode([token]))
        self._tool_call_parser = config.tool_call_parser or parser_for_template(template.source)
        self.served_model_name = served_model_name
        self._router: RouterClient | None = None
        self._started = int(time.time())

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        self._router = RouterClient(self._config)  # grpc.aio channels belong to the running loop
        log.info("gateway ready: http=%s:%d router=%s model=%s", self._config.host, self._config.port,
                 self._config.router_address, self.served_model_name)
        yield
        await self._router.close()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models), web.get("/v1/models/{model:.+}", self.model),
                web.get("/health", self.health), web.get("/live", self.live), web.get("/version", self.version),
                web.get("/metrics", self.metrics),
                *TokenizerEndpoints(self._template, self.served_model_name, lambda: self._router).routes()]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        check_model(requested_model(body), self.served_model_name)
        api = parse_completion(body)
        max_context = self._template.max_context  # 0: unknown, and the router checks alone
        if max_context and (problem := prompt_size_problem(api.prompt, max_context)):
            raise bad_request("prompt", problem)  # here: too large a prompt would outgrow the router's message cap
        return await self._answer(request, api)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = parse_json_object(raw)
        check_model(requested_model(body), self.served_model_name)
        if len(raw) > THREAD_TOKENIZE_CHARS or body.get_list("tools"):  # templating, tokenizing, schema checks
            return await self._answer(request, await asyncio.to_thread(parse_chat, body, self._template,
                                                                       self._tool_call_parser))
        return await self._answer(request, parse_chat(body, self._template, self._tool_call_parser))

    async def _answer(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        request_id = request[_REQUEST_ID]
        meta = AnswerMeta(ID_PREFIX[api.endpoint] + request_id, int(time.time()), api.model, api.endpoint,
                          include_usage=api.stream and api.include_usage, n=api.n,
                          logprobs=api.wants_logprobs, echo=api.echo, token_text=self._token_text,
                          return_token_ids=api.return_token_ids, chat_output=self._chat_output(api))
        router_request = api.to_router(request_id)
        _trace_request_attributes(api, router_request)
        answer = self._router.generate(router_request, api.params)
        try:
            if api.stream:
                return await streamed_answer(request, meta, answer, {REQUEST_ID_HEADER: request_id})
            return await whole_answer(meta, answer)
        finally:
            await answer.close()  # finished: let it end; client gone or failed: the router cancels the workers

    def _chat_output(self, api: ApiRequest) -> ChatOutputFactory | None:
        """How each chat choice's text splits into reasoning, content and tool calls (None: all content)."""
        reasoning_kind = self._config.reasoning_parser
        has_tool_parser = api.tools is not None and api.tools.choice != "none"
        if api.endpoint != Endpoint.CHAT or not (reasoning_kind or has_tool_parser):
            return None
        tools, tool_parser = api.tools, self._tool_call_parser
        return lambda: ChatOutput(ReasoningParser(reasoning_kind) if reasoning_kind else None,
                                  tools.new_parser(tool_parser) if has_tool_parser else None)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        check_model(request.match_info["model"], self.served_model_name)
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.served_model_name, "object": "model", "created": self._started, "owned_by": "distserve"}

    async def health(self, request: web.Request) -> web.Response:
        """200 when the router answers and a prefill and a decode worker are registered; else 503."""
        problems = await self._router.readiness_problems()
        if problems:
            return web.json_response({"status": "unavailable", "problems": problems}, status=503)
        return web.json_response({"status": "ok"})

    async def live(self, request: web.Request) -> web.Response:
        """200 whenever the process answers, whatever its peers' state: what a liveness probe (the
        launcher's supervisor, a kubelet) restarts on, without /health's router call and registry reads."""
        return web.json_response({"status": "live"})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": distserve.__version__})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(self._metrics.registry),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def create_app(config: GatewayConfig, template: ChatTemplate, served_model_name: str) -> web.Application:
    metrics = GatewayMetrics()
    middlewares = [error_middleware, tracing_middleware(metrics)]
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key))
    if config.rate_limit_rps:
        buckets = TokenBuckets(config.rate_limit_rps, config.rate_limit_burst_size)
        middlewares.append(rate_limit_middleware(buckets, _is_generation))
    middlewares.append(body_deadline_middleware(config.body_timeout_s))  # after the key: strangers send no body
    app = web.Application(middlewares=middlewares, client_max_size=int(config.max_body_mb * 2**20))
    gateway = Gateway(config, template, served_model_name, metrics)
    app.cleanup_ctx.append(gateway.lifespan)
    app.add_routes(gateway.routes())
    return app


def _trace_request_attributes(api: ApiRequest, router_request) -> None:
    sampling = router_request.sampling
    attributes = {"gen_ai.operation.name": "chat" if api.endpoint == Endpoint.CHAT else "text_completion",
                  "gen_ai.request.model": api.model}
    for name in ("max_tokens", "temperature", "top_p"):
        if sampling.HasField(name):
            attributes[f"gen_ai.request.{name}"] = getattr(sampling, name)
    tracing.current_span().set_attributes(attributes)


def tracing_middleware(metrics: GatewayMetrics) -> Callable:
    """The request's root span (or a child of the client's traceparent), keyed by its request id; metrics."""

    @web.middleware
    async def trace_and_count(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _is_api(request.path):
            return await handler(request)
        started = time.monotonic()
        path = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        with tracing.remote_context(dict(request.headers)), tracing.span(
                "gateway.http", request.get(_REQUEST_ID, ""), **{"http.request.method": request.method,
                                                                 "url.path": request.path}) as span:
            try:
                response = await handler(request)
            except ApiError as exc:
                metrics.requests.labels(path=path, status=str(exc.status)).inc()
                raise
            span.set_attribute("http.response.status_code", response.status)
            metrics.requests.labels(path=path, status=str(response.status)).inc()
            metrics.duration.labels(path=path).observe(time.monotonic() - started)
            return response

    return trace_and_count


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Assigns the request id (X-Request-Id in and out) and turns every failure into an OpenAI error."""
    try:
        request[_REQUEST_ID] = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        response = await handler(request)
    except ApiError as exc:
        response = error_response(exc)
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too large
        response = error_response(_from_http_exception(exc, request))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = error_response(internal_error())
    if not response.prepared:  # a stream sets its own headers before it starts
        response.headers[REQUEST_ID_HEADER] = request.get(_REQUEST_ID) or uuid.uuid4().hex
    return response


def api_key_middleware(api_key: str) -> Callable:
    """401 on /v1/*, /tokenize, /detokenize and /metrics unless `Authorization: Bearer <api_key>`; /health,
    /live and /version stay open (probes carry no key and learn nothing private from them)."""
    expected = api_key.encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _is_api(request.path) or request.path == "/metrics":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                raise ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                               code="invalid_api_key")
        return await handler(request)

    return check_api_key


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _is_generation(path: str) -> bool:
    """The paths that start model work, which rate limits apply to."""
    return path in GENERATION_PATHS


def _is_api(path: str) -> bool:
    """The OpenAI/vLLM API paths: keyed, traced and counted."""
    return path.startswith("/v1/") or path in TOKENIZER_PATHS


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id, checked as the router checks it, or a new one."""
    if header is None:
        return uuid.uuid4().hex
    if not (0 < len(header) <= MAX_REQUEST_ID_LEN and header.isascii() and header.isprintable()):
        raise bad_request(None, f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_LEN} printable "
                                "ASCII characters")
    return header


def error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers())


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return ApiError(404, f"no route {request.method} {request.path}", code="not_found")
    if exc.status == 405:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}", code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"the request body is too large: {exc.text}", code="request_too_large")
    return ApiError(exc.status, exc.reason or "HTTP error", type="invalid_request_error" if exc.status < 500
                    else "server_error")
