"""Each subject's effective policy (user policy + always-rules) and its IP layer, cached.

The DNS proxy asks for the effective policy on every query and the MITM for the IP layer on
every request that is not towards a DNS-learned address: both are kept while the policy and
the always-rules objects they came from are unchanged.
"""

from __future__ import annotations

from egressd.policy import AlwaysRules, IpSets, NetworkPolicy, effective_policy, ip_sets
from egressd.subject.registry import Entry, State


class EffectivePolicies:
    def __init__(self, always: AlwaysRules) -> None:
        # The always-rules in force; swapped only by the always-rules reload, under the
        # kernel lock (every transaction after the swap uses the new ones).
        self.always = always
        self._effective: dict[str, tuple[NetworkPolicy, AlwaysRules, NetworkPolicy]] = {}
        self._ip_sets: dict[str, tuple[NetworkPolicy, IpSets]] = {}

    def effective(self, user: NetworkPolicy) -> NetworkPolicy:
        return effective_policy(user, self.always)

    def effective_for(self, entry: Entry) -> NetworkPolicy | None:
        """The entry's effective policy, cached; None unless active."""
        if entry.state is not State.ACTIVE or entry.policy is None:
            return None
        cached = self._effective.get(entry.uid)
        if cached is not None and cached[0] is entry.policy and cached[1] is self.always:
            return cached[2]
        eff = self.effective(entry.policy)
        self._effective[entry.uid] = (entry.policy, self.always, eff)
        return eff

    def ip_sets_of(self, uid: str, effective: NetworkPolicy) -> IpSets:
        """``ip_sets(effective)``, kept while the effective policy object is unchanged."""
        cached = self._ip_sets.get(uid)
        if cached is not None and cached[0] is effective:
            return cached[1]
        sets = ip_sets(effective)
        self._ip_sets[uid] = (effective, sets)
        return sets

    def forget(self, uid: str) -> None:
        self._effective.pop(uid, None)
        self._ip_sets.pop(uid, None)
