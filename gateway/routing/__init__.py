"""Routing: which prefill and decode worker serve a request.

``interfaces`` holds what a picker sees and returns (``RouteRequest``, ``Route``) and the
``Picker`` protocol; ``registry`` the pickers by name, each plugin module adding itself;
``plugins`` imports the built-in ones (``round_robin``; ``prefix``, the Redis prefix-cache
and load scorer with the shared KV tier's index in ``kv_tier``). A new picker is one module
here that registers itself, listed in ``plugins``, with its unit test.
"""
