"""The inference core: paged KV cache, scheduler, model runner, sampler, engine loop.

Never imports gRPC or a service.
"""
