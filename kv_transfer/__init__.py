"""pdserve's vLLM KV connector and its transport.

vLLM loads ``kv_transfer.connector.PdserveConnector`` through ``KVTransferConfig``. The engine
side (``connector``, ``scheduler``, ``worker``) only decides what moves; the bytes move in a
separate transfer process (``agent``) that maps the worker's KV cache memory, so copies and
socket work never run under the engine's GIL or on its busy step loop.
"""

CONNECTOR_NAME = "PdserveConnector"
CONNECTOR_MODULE = "kv_transfer.connector"
