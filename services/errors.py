"""ringwatch's typed errors; the API maps each to one HTTP status in one handler."""


class RingwatchError(Exception):
    status_code = 400
    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadInput(RingwatchError):
    status_code = 422
    code = "invalid_input"


class NotFound(RingwatchError):
    status_code = 404
    code = "not_found"


class NodeNotFound(NotFound):
    code = "node_not_found"


class Unauthorized(RingwatchError):
    status_code = 401
    code = "unauthorized"


class Forbidden(RingwatchError):
    status_code = 403
    code = "forbidden"


class Conflict(RingwatchError):
    """The request contradicts what is stored (a batch id reused for other content)."""

    status_code = 409
    code = "conflict"


class NotLeader(Conflict):
    """A scheduler acted for a fleet whose lease another holds, or that ran out."""

    code = "not_leader"


class TooLarge(RingwatchError):
    status_code = 413
    code = "too_large"


class RetryLater(RingwatchError):
    """An error the client should retry after ``retry_after_s`` (sent as ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyRequests(RetryLater):
    """This client has too much outstanding."""

    status_code = 429
    code = "too_many_requests"


class Busy(RetryLater):
    """The service cannot take this now."""

    status_code = 503
    code = "busy"


class DatabaseUnavailable(RetryLater):
    """The database is down or too slow to answer."""

    status_code = 503
    code = "database_unavailable"


class NotReady(RingwatchError):
    """This process cannot serve now: its database is unreachable or at another migration."""

    status_code = 503
    code = "not_ready"


class NotConfigured(RingwatchError):
    """The operator has not set what this needs (a setting named in the message)."""

    status_code = 503
    code = "not_configured"
