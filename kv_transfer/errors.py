"""Errors of the KV transport; each carries a message fit to show a user."""


class KVTransferError(Exception):
    """A transfer failed; the decode request must not use the blocks it was pulling."""


class IncompatibleWorkers(KVTransferError):
    """Two workers disagree on something that makes their KV blocks unexchangeable."""


class UnknownRequest(KVTransferError):
    """The prefill worker holds no blocks for the request (never registered, expired, released)."""


class UnsupportedKVCache(KVTransferError):
    """The KV cache cannot be served by this connector (e.g. device memory)."""


class PromptMismatch(KVTransferError):
    """A hand-off does not belong to the prompt it was sent with (or its seal is not genuine)."""


class JobEnded(UnknownRequest):
    """The prefill worker held the request's blocks once and no longer does (pulled, released,
    lease expired), or the hand-off is from an earlier start of the prefill worker."""
