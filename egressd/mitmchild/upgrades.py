"""Upgrades the MITM lets through: WebSocket only (docs/reference/behaviour.md §18).

mitmproxy's own guard strips ``Upgrade: h2c`` only in that exact case, and after any other
``101 Switching Protocols`` it relays the connection as raw TCP, where no request's ``Host`` is
checked any more. So every ``Upgrade`` other than ``websocket`` (any case) is removed before the
request goes upstream, with the ``Connection`` and ``HTTP2-Settings`` headers that go with it;
HTTP/2 prior knowledge is still killed by mitmproxy's guard.
"""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.addons.disable_h2c import DisableH2C


def strip_upgrade(headers: http.Headers) -> bool:
    """Remove a non-WebSocket upgrade from ``headers``; True when one was there."""
    values = [v.strip().lower() for v in ",".join(headers.get_all("upgrade")).split(",") if v.strip()]
    if not values or values == ["websocket"]:
        return False
    for name in ("upgrade", "connection", "http2-settings"):
        if name in headers:
            del headers[name]
    return True


class OnlyWebSocketUpgrades(DisableH2C):
    def process_flow(self, f: http.HTTPFlow) -> None:
        strip_upgrade(f.request.headers)
        super().process_flow(f)  # type: ignore[no-untyped-call]
