"""The built-in pickers: importing this module registers each in ``gateway.routing.registry``.
A new built-in picker is a module of this package that registers itself, imported here."""

from gateway.routing import prefix, round_robin

BUILT_IN = (round_robin.RoundRobinPicker.name, prefix.PrefixPicker.name)
