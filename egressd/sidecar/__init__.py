"""The sidecar profile (docs/reference/behaviour.md §13): one implicit subject, the whole sandbox namespace."""
