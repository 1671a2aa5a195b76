"""Addresses as every layer of egressd handles them: the one address type and the IPv4-mapped
rule. A model at the bottom of the import graph (it imports nothing of egressd), so the policy,
the subjects and the kernel can share it without importing one another."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def unmap_ip(ip: IPAddress) -> IPAddress:
    """IPv4-mapped IPv6 addresses dispatch as their IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
