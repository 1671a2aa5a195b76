"""What operators see of a subject's refusals and answers (docs/reference/behaviour.md §15).

``dns``: the DNS proxy's one hook into all of it. ``webhook``: the reference's denied-name
callback (``OPENSANDBOX_EGRESS_DENY_WEBHOOK``). ``outbound``: the ``egress.outbound`` event
for allowed answers. ``denials``: a small per-subject ring of recent denials for
``egressctl``. Nothing here ever sees a credential: the DNS proxy hands over names, rules
and addresses only.
"""
