"""Every fuzz finding as a plain unit test (docs/reliability.md, "Fuzzing")."""

from __future__ import annotations

from egressd.mitm.inject import Request

PLACEHOLDER = "__PH_TOKEN__"


def test_mitm_request_repr_hides_content_type_and_encoding() -> None:
    # Finding F1 (mitm target): Content-Type / Content-Encoding are request header values the
    # sandbox controls and may carry a placeholder (a redaction string), yet Request's repr()
    # showed them while hiding every other header.
    req = Request(
        scheme="https",
        host="api.example.com",
        port=443,
        method="GET",
        path="/",
        content_type=PLACEHOLDER,
        content_encoding=PLACEHOLDER,
    )
    assert PLACEHOLDER not in repr(req) and PLACEHOLDER not in str(req)
