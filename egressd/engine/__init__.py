"""The subject engine both profiles run, over a ruleset backend protocol (issue 24 item 1).

:mod:`egressd.engine.subjects` holds every subject's DNS leases and decides learning,
narrowing, flow cuts and destination checks; :mod:`egressd.engine.backend` is the protocol a
profile's kernel side implements (the fleet's :mod:`egressd.fleetnft.backend`, the sidecar's
:mod:`egressd.sidecarnft.backend`) and :mod:`egressd.engine.errors` its two failures;
:mod:`egressd.engine.selftest` runs a backend's start-up probes; :mod:`egressd.engine.refusals`
exports a backend's refusal counts; :mod:`egressd.engine.flows`, :mod:`egressd.engine.learning`
and :mod:`egressd.engine.counters` are the procedures the engine and the profiles share.
"""
