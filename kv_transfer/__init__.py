"""pdserve's vLLM KV connector and its transport.

vLLM loads ``kv_transfer.connector.PdserveConnector`` through ``KVTransferConfig``. The engine
side (``connector``, ``scheduler``, ``worker``) only decides what moves; the bytes move in a
separate transfer process (``agent``) that maps the worker's KV cache memory, so copies and
socket work never run under the engine's GIL or on its busy step loop.
"""

CONNECTOR_NAME = "PdserveConnector"
CONNECTOR_MODULE = "kv_transfer.connector"
TIER_CONNECTOR_NAME = "PdserveTierConnector"
TIER_CONNECTOR_MODULE = "kv_transfer.lmcache_tier"


def register_connectors() -> None:
    """Make our connectors known to vLLM's connector factory by name (idempotent).

    Under ``MultiConnector`` vLLM's front-end rebuilds each child's statistics by the child's
    class name, which works only for registered connectors."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in ((CONNECTOR_NAME, CONNECTOR_MODULE),
                         (TIER_CONNECTOR_NAME, TIER_CONNECTOR_MODULE)):  # fmt: skip
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
