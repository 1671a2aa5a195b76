"""structlog configuration: JSON lines (default) or console output on stderr."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

from egressd.terminal import visible


def constant_fields(fields: Mapping[str, str]) -> structlog.typing.Processor:
    """Adds ``fields`` (OPENSANDBOX_EGRESS_SANDBOX_ID, ..._METRICS_EXTRA_ATTRS) to every line;
    a key the line sets itself keeps the line's value."""
    frozen = dict(fields)

    def add(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in frozen.items():
            event_dict.setdefault(key, value)
        return event_dict

    return add


def visible_fields(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console lines (docs/reference/behaviour.md §20.3): every text field with its control characters made
    visible. DNS names, SNI, paths and names come from sandboxes, tenants and upstreams, and the
    console renderer prints text as it is (JSON lines are escaped by the encoder). A traceback
    keeps its line breaks, each of its lines escaped."""
    for key, value in list(event_dict.items()):
        if key == "exception" and isinstance(value, str):
            event_dict[key] = "\n".join(visible(line) for line in value.split("\n"))
        elif isinstance(value, str):
            event_dict[key] = visible(value)
    return event_dict


def configure(fmt: str = "json", level: int = logging.INFO, fields: Mapping[str, str] | None = None) -> None:
    console = fmt == "console"
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=False) if console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *([constant_fields(fields)] if fields else []),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *([visible_fields] if console else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # aiohttp's access log would print request lines; keep it quiet.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    guard_aiohttp_server_log()


def guard_aiohttp_server_log() -> None:
    """aiohttp's server logger quotes the offending bytes of a malformed request (a vault push,
    a binding input) with a traceback, through Python's last-resort stderr handler. Keep only
    the kind of failure, as one of our own log lines."""
    server = logging.getLogger("aiohttp.server")
    server.handlers = [_RequestErrors()]
    server.propagate = False


class _RequestErrors(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = record.exc_info[1] if record.exc_info else None
            structlog.get_logger("egressd.http").warning(
                "http.request_error", error=type(exc).__name__ if exc is not None else None
            )
        except Exception:  # a log handler must never raise into aiohttp
            pass
