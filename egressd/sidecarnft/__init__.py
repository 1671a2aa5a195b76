"""The sidecar's nftables ruleset (BEHAVIOUR §8.6): pure generation and a start-up self-test."""
