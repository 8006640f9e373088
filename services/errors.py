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
