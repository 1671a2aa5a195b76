"""The sidecar profile's configuration: the options only the sidecar reads
(its API token, its initial policy, its mode, keeping its table on SIGTERM), composed with the
subsystems' frozen configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from egressd.commonconfig import CommonConfig
from egressd.dnsproxy.config import DnsConfig
from egressd.kernel.config import KernelConfig
from egressd.mitm.config import MitmConfig
from egressd.options import Option, Raw, parse_bool, parse_choice
from egressd.vault.config import VaultConfig

OPTIONS: tuple[Option, ...] = (
    Option("OPENSANDBOX_EGRESS_TOKEN", "--token", "sidecar: API token", profile="sidecar"),
    Option("OPENSANDBOX_EGRESS_RULES", "--rules", "sidecar: initial policy JSON", profile="sidecar"),
    Option("OPENSANDBOX_EGRESS_POLICY_FILE", "--policy-file", "sidecar: initial policy file", profile="sidecar"),
    Option("OPENSANDBOX_EGRESS_MODE", "--mode", "sidecar: dns or dns+nft", "dns+nft", profile="sidecar"),
    Option(
        "EGRESSD_SIDECAR_KEEP_TABLE",
        "--sidecar-keep-table",
        "sidecar: keep the nft table on SIGTERM (restart without an open window)",
        boolean=True,
        profile="sidecar",
    ),
)


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    common: CommonConfig
    dns: DnsConfig
    mitm: MitmConfig
    vault: VaultConfig
    kernel: KernelConfig
    token: str | None = field(default=None, repr=False)
    rules: str | None = None
    policy_file: Path | None = None
    mode: str = "dns+nft"
    keep_table: bool = False

    @property
    def profile(self) -> str:
        return "sidecar"


def load_mode(raw: Raw) -> str:
    return parse_choice(raw, "OPENSANDBOX_EGRESS_MODE", "dns+nft", ("dns", "dns+nft"), "dns or dns+nft")


def load(
    raw: Raw, mode: str, subsystems: tuple[CommonConfig, DnsConfig, MitmConfig, VaultConfig, KernelConfig]
) -> SidecarConfig:
    common, dns, mitm, vault, kernel = subsystems
    policy_file = raw["OPENSANDBOX_EGRESS_POLICY_FILE"]
    return SidecarConfig(
        common=common,
        dns=dns,
        mitm=mitm,
        vault=vault,
        kernel=kernel,
        token=raw["OPENSANDBOX_EGRESS_TOKEN"] or None,
        rules=raw["OPENSANDBOX_EGRESS_RULES"],
        policy_file=Path(policy_file) if policy_file else None,
        mode=mode,
        keep_table=parse_bool("EGRESSD_SIDECAR_KEEP_TABLE", raw["EGRESSD_SIDECAR_KEEP_TABLE"]),
    )
