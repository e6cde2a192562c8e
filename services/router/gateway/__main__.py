"""python -m services.router.gateway: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from distserve import event_loop
from distserve.config import parse_config
from distserve.engine.model_loader import load_tokenizer, resolve_model_path
from distserve.model_spec import load_model_spec
from distserve.logs import setup_logging
from distserve.tracing import init_tracing, shutdown_tracing
from services.router.gateway.app import create_app
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.config import GatewayConfig
from services.router.gateway.limits import GuardedRunner

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    setup_logging("gateway")
    init_tracing("distserve-gateway")
    config = parse_config(GatewayConfig, argv, prefix="DISTSERVE_GATEWAY_").with_api_key_from_file()
    path = resolve_model_path(config.model)
    template = ChatTemplate(load_tokenizer(path), load_model_spec(path).max_context, config.load_chat_template())
    app = create_app(config, template, config.served_model_name or Path(path).name)
    event_loop.run(serve(app, config))
    shutdown_tracing()


async def serve(app: web.Application, config: GatewayConfig) -> None:
    """Serves until SIGTERM or SIGINT, then lets in-flight requests finish for shutdown_grace_s."""
    # handler_cancellation: a client that disconnects cancels its handler, and so its router call.
    runner = GuardedRunner(app, max_connections=config.max_connections, header_timeout_s=config.header_timeout_s,
                           handler_cancellation=True, shutdown_timeout=config.shutdown_grace_s,
                           keepalive_timeout=config.keepalive_timeout_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        log.info("gateway ready: http://%s:%d", config.host, config.port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
