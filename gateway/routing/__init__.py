"""Where a request goes: the worker fleets (discovery), what the gateway knows of each
worker, the prefix-cache index fed by the workers' KV events, the router's picks, and the
dispatcher that runs a request's ``Decode`` calls with their retries and mid-stream moves.

It imports nothing from the gateway's front ends (HTTP or gRPC surface).
"""
