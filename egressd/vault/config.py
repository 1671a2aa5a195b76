"""The vaults' options: size caps (docs/reference/behaviour.md §14.7), the write
transport and binding scope (reference sidecar parity, issue 15 item 3), and the fleet's
sealed-vault keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from egressd.options import IPNetwork, Option, Raw, parse_bool, parse_int, parse_networks
from egressd.vault.types import VaultLimits, compile_ignore_hosts

OPTIONS: tuple[Option, ...] = (
    Option(
        "EGRESSD_VAULT_MAX_CREDENTIALS",
        "--vault-max-credentials",
        "credentials one vault may hold (docs/reference/behaviour.md §14.7)",
        "256",
    ),
    Option(
        "EGRESSD_VAULT_MAX_BINDINGS",
        "--vault-max-bindings",
        "bindings one vault may hold (docs/reference/behaviour.md §14.7)",
        "256",
    ),
    Option(
        "EGRESSD_VAULT_KEYS_DIR",
        "--vault-keys-dir",
        "fleet: sealed-vault key directory",
        profile="fleet",
        example="/etc/egressd/vault-keys",
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS",
        "--credential-vault-require-tls",
        "vault writes only from loopback or a trusted proxy asserting X-Forwarded-Proto: https (else 426)",
        boolean=True,
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH",
        "--credential-vault-require-scoped-match",
        "every vault binding must list its methods and paths, and no path may be /*",
        boolean=True,
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS",
        "--credential-vault-trusted-proxy-cidrs",
        "comma-separated IPs/CIDRs whose X-Forwarded-Proto: https counts as TLS",
        "",
    ),
)


@dataclass(frozen=True, slots=True)
class VaultConfig:
    max_credentials: int = 256  # EGRESSD_VAULT_MAX_CREDENTIALS (docs/reference/behaviour.md §14.7)
    max_bindings: int = 256  # EGRESSD_VAULT_MAX_BINDINGS (docs/reference/behaviour.md §14.7)
    keys_dir: Path | None = None  # EGRESSD_VAULT_KEYS_DIR (fleet)
    require_tls: bool = False  # OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS
    require_scoped_match: bool = False  # ..._CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH
    trusted_proxies: tuple[IPNetwork, ...] = ()  # ..._CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS

    def limits(self, ignore_hosts: tuple[str, ...]) -> VaultLimits:
        """``ignore_hosts``: the MITM's (a binding host it never decrypts could never be
        injected, §6: 400)."""
        return VaultLimits(
            credentials=self.max_credentials,
            bindings=self.max_bindings,
            require_scoped_match=self.require_scoped_match,
            ignore_hosts=compile_ignore_hosts(ignore_hosts),
        )


def load(raw: Raw) -> VaultConfig:
    keys_dir = raw["EGRESSD_VAULT_KEYS_DIR"]
    return VaultConfig(
        # No "0 = unlimited": the caps are what keeps validation cheap (14.7). The upper
        # bound is what a 1 MiB body could hold anyway.
        max_credentials=parse_int(
            "EGRESSD_VAULT_MAX_CREDENTIALS", raw["EGRESSD_VAULT_MAX_CREDENTIALS"] or "256", 1, 100_000
        ),
        max_bindings=parse_int("EGRESSD_VAULT_MAX_BINDINGS", raw["EGRESSD_VAULT_MAX_BINDINGS"] or "256", 1, 100_000),
        keys_dir=Path(keys_dir) if keys_dir else None,
        require_tls=parse_bool(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS"],
        ),
        require_scoped_match=parse_bool(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH"],
        ),
        trusted_proxies=parse_networks(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS"] or "",
        ),
    )
