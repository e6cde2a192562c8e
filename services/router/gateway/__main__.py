"""python -m services.router.gateway: run the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    setup_logging("gateway")
    init_tracing("distserve-gateway")
    config = parse_config(GatewayConfig, argv, prefix="DISTSERVE_GATEWAY_").with_api_key_from_file()
    path = resolve_model_path(config.model)
    template = ChatTemplate(load_tokenizer(path), load_model_spec(path).max_context, config.load_chat_template())
    app = create_app(config, template, config.served_model_name or Path(path).name)
    # handler_cancellation: a client that disconnects cancels its handler, and so its router call.
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True, print=None,
                shutdown_timeout=config.shutdown_grace_s, loop=event_loop.new_loop())
    shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
