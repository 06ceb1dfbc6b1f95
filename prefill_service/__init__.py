"""The prefill worker: gRPC service around one vLLM engine in the kv_producer role."""
