"""The MITM child (docs/reference/behaviour.md §10, §16): the process ``python -m egressd.mitmchild.runner``
that the daemon's supervisor (:mod:`egressd.mitm.supervisor`) starts, a lean mitmproxy master.

:mod:`egressd.mitmchild.inject` holds the pure decisions (binding match, refusals, header
injection, substitutions, response-header redaction) on plain data; the mitmproxy addons are
thin adapters around it and the other pure modules. Of the daemon's package it imports only
what both sides share: :mod:`egressd.mitm.protocol` and :mod:`egressd.mitm.seqmap`. Nothing in
this package's ``__init__`` imports mitmproxy.
"""
