"""The one error hierarchy of infermux.

Every error a client can see is an :class:`InfermuxError`. Each class carries the HTTP
status, the OpenAI error ``type`` and ``code`` it maps to; ``gateway/http/errors.py`` turns any of
them into the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` in one place.
Adapters translate their library's exceptions into this tree at their boundary
(``raise BackendUnavailable(...) from exc``); nothing else crosses a layer.

::

    InfermuxError                          500 server_error
    ├── InvalidRequestError                400 invalid_request_error
    │   ├── ContextLengthExceededError     400 context_length_exceeded
    │   ├── UnsupportedParameterError      400 unsupported_parameter
    │   └── RequestTooLargeError           413 request_too_large
    ├── AuthenticationError                401 invalid_api_key
    ├── PermissionDeniedError              403 permission_denied
    ├── NotFoundError                      404 not_found
    │   └── ModelNotFoundError             404 model_not_found
    ├── RateLimitError                     429 rate_limit_exceeded
    │   └── BudgetExceededError            429 budget_exceeded
    ├── ServerOverloadedError              503 server_is_overloaded
    ├── StateStoreUnavailableError         503 state_store_unavailable (Redis down, fail closed)
    └── BackendError                       502 backend_error          (upstream trouble)
        ├── BackendUnavailableError        503 backend_unavailable    (retryable)
        │   └── BackendConfigError         503 backend_misconfigured  (cannot start as configured)
        ├── UpstreamRateLimitError         429 rate_limit_exceeded    (retryable on another)
        ├── UpstreamStatusError            502 upstream_error         (5xx: retryable)
        ├── UpstreamTimeoutError           504 upstream_timeout       (retryable)
        ├── UpstreamStreamBrokenError      502 upstream_stream_broken (after output: resumable)
        ├── StreamIdleTimeoutError         504 stream_idle_timeout    (after output: resumable)
        └── GenerationAbortedError         499 request_aborted
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "BackendConfigError",
    "BackendError",
    "BackendUnavailableError",
    "BudgetExceededError",
    "ContextLengthExceededError",
    "GenerationAbortedError",
    "InfermuxError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "ServerOverloadedError",
    "StateStoreUnavailableError",
    "StreamIdleTimeoutError",
    "UnsupportedParameterError",
    "UpstreamRateLimitError",
    "UpstreamStatusError",
    "UpstreamStreamBrokenError",
    "UpstreamTimeoutError",
]


class InfermuxError(Exception):
    """Base of every error a client can see.

    ``param`` names the request parameter at fault (``"max_tokens"``, ``"messages"``) or is
    ``None``. ``retry_after`` (seconds) becomes a ``Retry-After`` header. ``headers`` are extra
    response headers (``x-ratelimit-*``).
    """

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = "internal_error"
    #: True when the router may try another backend (only before the first byte is sent).
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, object]:
        """The OpenAI error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(InfermuxError):
    """The request is malformed or a parameter is out of range; ``param`` names it."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus ``max_tokens`` does not fit the model's context window."""

    code = "context_length_exceeded"


class UnsupportedParameterError(InvalidRequestError):
    """The chosen backend cannot honour a parameter (declared in its capabilities)."""

    code = "unsupported_parameter"


class RequestTooLargeError(InvalidRequestError):
    """Body or a field over the configured size limit."""

    status_code = 413
    code = "request_too_large"


class AuthenticationError(InfermuxError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(InfermuxError):
    status_code = 403
    error_type = "permission_error"
    code = "permission_denied"


class NotFoundError(InfermuxError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class RateLimitError(InfermuxError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BudgetExceededError(RateLimitError):
    code = "budget_exceeded"


class ServerOverloadedError(InfermuxError):
    status_code = 503
    error_type = "server_error"
    code = "server_is_overloaded"


class StateStoreUnavailableError(InfermuxError):
    """The shared state store ([state] backend = "redis") cannot be reached and
    ``on_unavailable = "closed"``: no request is admitted that limits could not count."""

    status_code = 503
    error_type = "server_error"
    code = "state_store_unavailable"


class BackendError(InfermuxError):
    """Trouble in or on the way to a backend."""

    status_code = 502
    error_type = "server_error"
    code = "backend_error"


class BackendUnavailableError(BackendError):
    """Connection refused, backend not loaded, circuit open: try another backend."""

    status_code = 503
    code = "backend_unavailable"
    retryable = True


class BackendConfigError(BackendUnavailableError):
    """The backend cannot start as configured (a missing model file, options this machine
    cannot run). ``infermux serve`` exits at start-up on it unless the backend is ``optional``.
    """

    code = "backend_misconfigured"


class UpstreamRateLimitError(BackendError):
    """The upstream answered 429; ``retry_after`` carries its ``Retry-After``."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retryable = True


class UpstreamStatusError(BackendError):
    """The upstream answered 5xx (retryable) or an unexpected status."""

    code = "upstream_error"
    retryable = True


class UpstreamTimeoutError(BackendError):
    """No first byte (or no connection) within the backend's timeout."""

    status_code = 504
    code = "upstream_timeout"
    retryable = True


class UpstreamStreamBrokenError(BackendError):
    """The upstream's stream broke after output began: the connection was reset or closed
    mid-body (its process died, a chunked body cut without its last chunk, TLS closed without
    close_notify), or it sent an error or undecodable event. The router never retries it (the
    client has output already); with ``resume_on_failure`` the next backend continues the
    answer (``gateway/serving/stream_resume.py``), hence retryable."""

    code = "upstream_stream_broken"
    retryable = True


class StreamIdleTimeoutError(BackendError):
    """The stream went silent for longer than the idle timeout after it started. Retryable
    in the same sense as :class:`UpstreamStreamBrokenError`: only a resume acts on it."""

    status_code = 504
    code = "stream_idle_timeout"
    retryable = True


class GenerationAbortedError(BackendError):
    """The request was cancelled (client gone, drain window over)."""

    status_code = 499
    error_type = "invalid_request_error"
    code = "request_aborted"
