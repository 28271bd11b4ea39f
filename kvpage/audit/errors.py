"""Typed errors of the auditor. Each one the CLI prints as one `error:` line with exit status 2:
the audit could not be carried out, which says nothing about the server's isolation."""

from __future__ import annotations

from kvpage.errors import KVPageError


class AuditError(KVPageError):
    """Base of every error that stops an audit."""


class AuditUsageError(AuditError):
    """A bad option (a base URL that is not http(s)://host[:port], an unknown suite, ...)."""


class ServerUnreachable(AuditError):
    """No HTTP answer from the base URL (refused, DNS, timeout)."""


class AuthFailed(AuditError):
    """The server answered 401/403: the API key is missing or wrong."""


class ServerIncompatible(AuditError):
    """The server answers, but offers nothing the audit can use (no completions, no chat)."""


class RequestRejected(AuditError):
    """One request got a 4xx/5xx answer; capability probing turns these into 'not supported'."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class BudgetExhausted(AuditError):
    """--budget-requests is spent; suites stop and report what they could not do."""
