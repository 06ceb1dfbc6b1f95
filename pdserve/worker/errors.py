"""Domain errors of the workers, mapped to gRPC status codes in ``server.grpc_code``."""


class WorkerError(Exception):
    """Base class; the message is shown to the caller."""


class InvalidRequest(WorkerError):
    pass


class EngineUnavailable(WorkerError):
    pass


class KVTransferFailed(WorkerError):
    """The decode worker could not pull the prompt's KV blocks from the prefill worker."""


class RequestAborted(WorkerError):
    pass
