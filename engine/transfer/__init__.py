"""KV-cache transport between a prefill worker and a decode worker: one interface, several backends."""
