"""structlog configuration: JSON lines (default) or console output on stderr."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "json", level: int = logging.INFO) -> None:
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # aiohttp's access log would print request lines; keep it quiet.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
