"""Extension points of the gateway, as Protocols.

- ``Picker``: chooses the prefill and decode worker of one request (routing plugins such as a
  Redis prefix-cache scorer implement it; registered by name in ``gateway.routing.PICKERS``).
- ``RouteFeedback``: what a picker learns once a routed prompt was computed (the prefix
  picker keeps the shared KV tier's index entries with it).
- ``PromptTokenizer``: turns prompts into token ids (``gateway.tokenizer.HfTokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gateway.pool import DecodeWorker, PrefillWorker, Worker
    from gateway.routing import Route, RouteRequest


class Picker(Protocol):
    """Chooses workers for one request.

    ``pick`` gets only healthy workers (the pool filters first) and a ``compatible(p, d)``
    predicate that is False when the two workers' ``kv_compat`` differ: a picker must never
    return such a pair. It returns a ``Route``: ``prefill`` None means the decode worker
    computes the prompt itself ("local" path, e.g. no prefill worker fits or the uncached part
    is short). ``decode`` is never empty in the input; raising ``NoWorkerAvailable`` is how a
    picker refuses. ``pick`` may await (e.g. a Redis lookup) but should not take long: it runs
    before every request's first token.
    """

    name: str

    async def pick(
        self,
        request: RouteRequest,
        prefill: Sequence[PrefillWorker],
        decode: Sequence[DecodeWorker],
        compatible: CompatibilityCheck,
    ) -> Route: ...

    async def close(self) -> None:
        """Let background work (index writes) finish; called once when the gateway stops."""
        ...


class RouteFeedback(Protocol):
    """Carried by a ``Route`` (``feedback``) back to its picker, about the routed prompt only
    (not a migration's longer one)."""

    def computed(self, worker: Worker[Any], cached_tokens: int) -> None:
        """``worker`` computed the prompt and reported ``cached_tokens`` of it served from its
        caches (vLLM's own and its KV tier). Called once per computation (a prefill worker's
        answer; the decode worker's finish on the local path); must not block: any I/O goes
        to the background."""
        ...


class CompatibilityCheck(Protocol):
    def __call__(self, prefill: PrefillWorker, decode: DecodeWorker) -> bool: ...


class PromptTokenizer(Protocol):
    """Prompt -> token ids, with vLLM's conventions (see ``gateway.tokenizer``).

    Raises ``gateway.errors.InvalidRequest`` for prompts it cannot render (e.g. a chat the
    template rejects).
    """

    vocab_size: int

    def encode_text(self, text: str) -> list[int]:
        """Completions prompt; special tokens (BOS) added as the model's tokenizer does."""
        ...

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Chat messages ({"role", "content", ...}) rendered with the chat template (``tools``
        passed to it), generation prompt appended, encoded without extra special tokens."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text (special tokens kept)."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's text, as shown in logprobs."""
        ...
