"""The gateway: OpenAI HTTP and gRPC in front of prefill and decode workers.

It tokenizes once, picks a prefill and a decode worker, runs the prefill, hands its
``kv_transfer_params`` to the decode worker and streams the tokens back. It never imports vLLM
or torch. Layout: ``config`` (settings), ``server`` (wiring), ``service`` + ``generation`` (the
transport-agnostic core), ``http`` / ``grpc_api`` (adapters), ``pool`` + ``routing`` (workers,
picking), ``tokenizer``, ``metrics``, ``errors``, ``interfaces``.
"""
