"""Layers shared by the native models: norms, rotary embeddings, paged attention."""
