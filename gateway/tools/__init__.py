"""Tool calling, shared by both front ends: the tools a request offers and how they reach
the prompt (plan), the model's output read as calls (calls), and the same read as the
output streams (call_stream)."""
