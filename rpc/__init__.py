"""What the three services share on the wire side.

Server lifecycle, error mapping, proto<->engine conversion, worker configuration.
"""
