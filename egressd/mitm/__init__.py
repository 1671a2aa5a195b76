"""The MITM, daemon side (docs/reference/behaviour.md §10): what egressd runs in its own process for it.

Start-up (:mod:`~egressd.mitm.service`: the CA, its export, the private ``_active`` socket and
app (:mod:`~egressd.mitm.active`), the narrowing sequence map (:mod:`~egressd.mitm.seqmap`)),
the supervised child processes (:mod:`~egressd.mitm.supervisor`, :mod:`~egressd.mitm.pool`,
the listener handover :mod:`~egressd.mitm.handover`). The child itself, a lean mitmproxy
master with egressd's addons, is :mod:`egressd.mitmchild`, another process; the two share
only :mod:`egressd.mitm.protocol` and the sequence map's format. Nothing in this package
imports mitmproxy.
"""
