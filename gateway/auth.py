"""API keys: the one place a request's credentials are checked (HTTP and gRPC alike).

Keys come from ``GatewaySettings.api_keys`` (env ``PDSERVE_GATEWAY_API_KEYS``, comma-separated)
and ``api_keys_file`` (one per line; blank lines and ``#`` comments ignored), read once at start.
No keys configured: every request is allowed. Transports pass the raw ``Authorization`` value
(HTTP header, gRPC metadata ``authorization``); ``/health`` and ``/metrics`` are not checked.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

from gateway.config import GatewaySettings
from gateway.errors import Unauthenticated

log = logging.getLogger(__name__)

_SCHEME = "bearer "


def load_keys(settings: GatewaySettings) -> tuple[str, ...]:
    keys = [k for k in settings.api_keys if k]
    if settings.api_keys_file:
        text = Path(settings.api_keys_file).read_text()
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(keys)


class ApiKeys:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> ApiKeys:
        keys = load_keys(settings)
        if settings.api_keys_file and not keys:
            log.warning("api_keys_file %s has no keys: no authentication", settings.api_keys_file)
        elif keys:
            log.info("API keys required (%d configured)", len(keys))
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise ``Unauthenticated`` unless ``authorization`` is ``Bearer <a configured key>``."""
        if not self._keys:
            return
        if not authorization or not authorization.lower().startswith(_SCHEME):
            raise Unauthenticated(
                "missing API key: send it as 'Authorization: Bearer <key>'", param=None
            )
        given = authorization[len(_SCHEME) :].strip().encode()
        # Compare with every key in constant time, so timing tells nothing about a key.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise Unauthenticated("invalid API key")
