"""Transparent MITM credential injection (docs/behaviour.md §10).

:mod:`egressd.mitm.inject` holds the pure decisions (binding match, refusals, header
injection, substitutions, response-header redaction) on plain data; the mitmproxy addon is a
thin adapter around it. Nothing in this package's ``__init__`` imports mitmproxy.
"""
