"""How a worker names pdserve's KV tier plugin to LMCache (no LMCache import: the worker's
own process builds the engine's environment from this before any engine starts).

LMCache loads "plug and play" remote connectors by module path from its ``extra_config``;
``kv_transfer.tier_integrity.PdserveTierAdapter`` is ours: it authenticates every chunk of a
shared tier with the deployment secret. The tier's location travels in ``TIER_URL_ENV``, not in
LMCache's configuration: LMCache logs its whole configuration at start-up, and the location of
a Redis tier holds its password.
"""

from __future__ import annotations

PLUGIN = "pdserve"
MODULE = "kv_transfer.tier_integrity"
ADAPTER = "PdserveTierAdapter"
TIER_URL_ENV = "PDSERVE_KV_TIER_REMOTE_URL"
SECRET_FILE_KEY = f"remote_storage_plugin.{PLUGIN}.secret_file"


def plugin_config(secret_file: str) -> dict[str, str]:
    """LMCache ``extra_config`` entries that load the ``pdserve`` plugin (a path, no secret)."""
    return {
        f"remote_storage_plugin.{PLUGIN}.module_path": MODULE,
        f"remote_storage_plugin.{PLUGIN}.class_name": ADAPTER,
        SECRET_FILE_KEY: secret_file,
    }
