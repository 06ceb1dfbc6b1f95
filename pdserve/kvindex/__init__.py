"""Which worker holds which KV blocks, and which workers exist: the shared record that
workers write (from vLLM's KV cache events and their heartbeats) and gateways read to route.

``interfaces`` defines the contracts, ``redis_store`` the Redis implementation (the only
module that knows the key layout, in ``keys``), ``memory`` an in-memory one for unit tests
and single-process runs, ``hashing`` the block hashes the gateway computes from token ids,
``epochs`` the worker lives that fence index writes, ``redis_client`` the client for a Redis
URL (one server or a Redis Cluster).
"""
