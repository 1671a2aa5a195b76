"""Credential vault (docs/reference/behaviour.md §6) and the sealed vault of the binding input (§11)."""
