"""The sidecar profile (BEHAVIOUR §13): one implicit subject, the whole sandbox namespace."""
