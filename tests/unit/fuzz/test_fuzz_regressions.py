"""Every fuzz finding as a plain unit test (docs/security.md, "Fuzzing")."""

from __future__ import annotations

from egressd.mitmchild.injectdata import Request

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


def test_missing_gateway_is_the_one_spec_500_without_a_kernel_cause() -> None:
    # Campaign note (actions target): SET_BINDING without attachment.network.gateway parses
    # (§1: "parse-optional; absent -> 500 at install") and the deny-first install then answers
    # 500 although the kernel never failed. Specified, so the fuzz oracle exempts exactly this.
    from tests.unit.fuzz import fleet as F
    from tests.unit.fuzz.support import run

    fleet = run(F.make_fleet())
    doc = F.set_binding("u-gw", "10.0.0.9")
    del doc["attachment"]["network"]["gateway"]
    status, text = run(fleet.act(doc))
    assert status == 500 and "attachment.network.gateway is required" in text
