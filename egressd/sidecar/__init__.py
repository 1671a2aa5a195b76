"""The sidecar profile (docs/behaviour.md §13): one implicit subject, the whole sandbox namespace."""
