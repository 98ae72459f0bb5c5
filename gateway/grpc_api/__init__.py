"""The gateway's gRPC surface: the public ``baton.v1.Baton`` service and the mapping of its
``GenerateRequest`` onto the one request path.

(Not named ``grpc``: a package of that name would read as the grpcio library.)
"""
