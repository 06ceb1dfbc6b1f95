"""Pickers by name: each plugin module adds its factory with ``register`` when it is imported
(``gateway.routing.plugins`` imports the built-in ones); ``GatewaySettings.picker`` names one.

The settings do not import the plugins: a name is checked against this registry where the
picker is made (``make_picker``) and, before anything starts, by ``pdserve gateway``
(``unknown_picker``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.offload import Offload
from gateway.routing.interfaces import Picker
from pdserve.kvindex.interfaces import PrefixIndex

AUTO = "auto"  # GatewaySettings.picker_name() resolves it to a registered name


@dataclass(frozen=True)
class PickerContext:
    """What a picker factory may use."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    index: PrefixIndex | None = None
    # Where CPU-heavy steps (block hashing) run, off the event loop; None: inline.
    offload: Offload | None = None


PickerFactory = Callable[[PickerContext], Picker]

PICKERS: dict[str, PickerFactory] = {}


def register(name: str) -> Callable[[PickerFactory], PickerFactory]:
    """Class or factory decorator: ``name`` makes a picker from a ``PickerContext``. A name is
    registered once (a second plugin with the same name is a programming error)."""

    def add(factory: PickerFactory) -> PickerFactory:
        if name in PICKERS or name == AUTO:
            raise ValueError(f"picker name {name!r} is taken")
        PICKERS[name] = factory
        return factory

    return add


def unknown_picker(name: str) -> str:
    """Why ``name`` is not a picker ("" when it is ``auto`` or registered)."""
    if name == AUTO or name in PICKERS:
        return ""
    return f"unknown picker {name!r}; known: {', '.join([AUTO, *sorted(PICKERS)])}"


def make_picker(name: str, context: PickerContext) -> Picker:
    problem = unknown_picker(name)
    if problem or name == AUTO:
        raise ValueError(problem or "resolve 'auto' with GatewaySettings.picker_name() first")
    return PICKERS[name](context)
