"""The sidecar's nftables ruleset (docs/reference/behaviour.md §8.6): pure generation and a start-up self-test."""
