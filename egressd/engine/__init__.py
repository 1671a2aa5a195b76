"""Subject-engine behaviour both profiles share (the fleet's ``egressd.actionhandler`` and the
sidecar's ``egressd.sidecar``): one implementation each profile calls with its own inputs.

Issue 24 item 1 grows this into the one subject engine; today it holds the flow-cut loop
(:mod:`egressd.engine.flows`), the counter read both profiles' visibility parts make
before a scrape (:mod:`egressd.engine.counters`), and the path that learns a DNS answer into a
lease book and verifies the MITM's destinations (:mod:`egressd.engine.learning`).
"""
