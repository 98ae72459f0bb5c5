"""Text processing at the gateway: the tokenizer (text and chat in, token ids out), the
chat turns it renders, incremental detokenization, stop strings, and the output processor
that turns decode's token deltas into the client's deltas.

Leaf package: it imports nothing from routing or either front end.
"""
