"""Code shared by the prefill and decode workers: settings, the vLLM engine wrapper, the
sampling-parameter translation, errors and the gRPC server skeleton."""
