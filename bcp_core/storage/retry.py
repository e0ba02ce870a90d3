"""Retries of storage requests: which failures are transient, the backoff (tenacity), and counts.

bcp decides *what* is worth retrying (network errors, throttling, 5xx: `is_transient`, which
reads botocore-style responses and exception names without importing any cloud library);
tenacity does the retrying (attempts, exponential backoff with full jitter). Every retry is
logged and counted (`retry_stats`, reported in save/load metrics).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import tenacity

from ..errors import StorageError, StorageFileNotFoundError, TransientStorageError
from ..utils import this_rank
from .base import CONFIG

log = logging.getLogger("bcp")

_TRANSIENT_CODES = {
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "ThrottlingException",
    "RequestLimitExceeded", "TooManyRequests", "RequestTimeTooSkewed", "BadDigest", "XAmzContentSHA256Mismatch",
}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Exception class names (anywhere in the MRO) from optional HTTP/cloud libraries that mean "try again";
# matched by name so that none of those libraries has to be imported.
_TRANSIENT_NAMES = {
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
    "IncompleteRead", "ResponseParserError", "FSTimeoutError", "HTTPClientError", "ProtocolError",
    "RetryError", "TransportError", "ServiceUnavailable", "TooManyRequests", "InternalServerError",
    "BadGateway", "GatewayTimeout",
}
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              ValueError, TypeError)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is a failure worth retrying: network, throttling, 5xx."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, TransientStorageError):
            return True
        if isinstance(e, StorageError):
            return False
        response = getattr(e, "response", None)  # botocore ClientError and alike
        if isinstance(response, dict):
            err = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return err.get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, _PERMANENT) and e.__cause__ is None:
            return False
        e = e.__cause__ or e.__context__
        seen += 1
    return False


_lock = threading.Lock()
_counts = {"retries": 0, "gave_up": 0}  # transient failures retried; operations failed for good


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


def retry_stats(reset: bool = False) -> dict[str, int]:
    """Counts of retried transient failures and of failed operations in this process."""
    with _lock:
        snap = dict(_counts)
        if reset:
            _counts.update(retries=0, gave_up=0)
    return snap


def with_retries(stage: str, where: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn, retrying transient failures with exponential backoff and jitter (CONFIG.retry_*).

    A permanent failure (or the last transient one) becomes a StorageError naming the
    rank, the stage (e.g. "upload part 3") and the file.
    """
    attempts = max(1, CONFIG.retry_attempts)

    def before_sleep(rs: tenacity.RetryCallState) -> None:
        e = rs.outcome.exception()
        _count("retries")
        log.warning("bcp: rank %s: transient error during %s %s (attempt %d/%d): %s: %s; retrying in %.2fs",
                    this_rank(), stage, where, rs.attempt_number, attempts, type(e).__name__, e,
                    rs.next_action.sleep)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_random_exponential(multiplier=CONFIG.retry_base_delay, max=CONFIG.retry_max_delay),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep, reraise=True)
    try:
        return retrying(fn, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - classified below
        transient = is_transient(e)
        if isinstance(e, StorageError) and not transient:
            raise  # already says where and why
        _count("gave_up")
        tried = retrying.statistics.get("attempt_number", 1)
        why = f"after {tried} attempts" if transient else "(permanent error, not retried)"
        cls = StorageFileNotFoundError if isinstance(e, FileNotFoundError) else StorageError
        raise cls(f"rank {this_rank()}: {stage} {where} failed {why}: {type(e).__name__}: {e}") from e
