"""Gateway service: validation, tokenization, routing and streaming to clients."""
