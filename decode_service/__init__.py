"""The decode worker: gRPC service around one vLLM engine in the kv_consumer role."""
