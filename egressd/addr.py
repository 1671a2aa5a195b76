"""Addresses as every layer of egressd handles them: the one address type and the IPv4-mapped
rule. A model at the bottom of the import graph (it imports nothing of egressd), so the policy,
the subjects and the kernel can share it without importing one another."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def unmap_ip(ip: IPAddress) -> IPAddress:
    """IPv4-mapped IPv6 addresses dispatch as their IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def host_network(ip: IPAddress) -> IPNetwork:
    """``ipaddress.ip_network(ip)``, the /32 or /128 of an address, built from its integer: the
    generic constructor formats the address as text and parses it again, three times the cost
    (a port-scoped DNS lease builds one per element set on the reply path)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ipaddress.IPv4Network(int(ip))
    if ip.scope_id is not None:
        return ipaddress.ip_network(ip)  # whatever the generic constructor makes of a zone
    return ipaddress.IPv6Network(int(ip))
