"""Human renderings of egressctl (tables, key/value blocks, flattened vault metadata)."""

from __future__ import annotations

from egressd.cli.render import REDACTED, flatten, key_values, redact_secrets, table


def test_table_aligns_columns_without_trailing_blanks() -> None:
    lines = table(("A", "BB", "C"), [("xxx", "y", ""), ("z", "wwww", "v")])
    assert lines == ["A    BB    C", "xxx  y", "z    wwww  v"]


def test_key_values() -> None:
    assert key_values([("a", "1"), ("long-key", "2")]) == ["a         1", "long-key  2"]
    assert key_values([]) == []


def test_flatten_names_list_items_by_name() -> None:
    doc = {
        "revision": 3,
        "credentials": [{"name": "gh", "sourceType": "inline", "revision": 2}],
        "bindings": [
            {
                "name": "b",
                "match": {"hosts": ["api.github.com"], "methods": []},
                "auth": {"type": "bearer"},
            }
        ],
        "flags": [{"x": True}, None],
        "empty": {},
    }
    assert flatten(doc) == [
        ("revision", "3"),
        ("credentials.gh.sourceType", "inline"),
        ("credentials.gh.revision", "2"),
        ("bindings.b.match.hosts", "api.github.com"),
        ("bindings.b.match.methods", "-"),
        ("bindings.b.auth.type", "bearer"),
        ("flags.0.x", "yes"),
        ("flags.1", "-"),
        ("empty", "-"),
    ]
    assert flatten([]) == [(".", "-")]
    assert flatten("text\nwith newline") == [(".", "text with newline")]


def test_redact_secrets() -> None:
    doc = {"credentials": [{"name": "gh", "source": {"type": "inline", "value": "s3cr3t"}}], "value": 1}
    assert redact_secrets(doc) == {
        "credentials": [{"name": "gh", "source": {"type": "inline", "value": REDACTED}}],
        "value": REDACTED,
    }
