"""Protocol buffers of pdserve (proto package ``pdserve.v1``) and their generated code.

Regenerate with ``make protos``; ``tests/unit/test_protos_fresh.py`` fails when the committed
code is stale.
"""
