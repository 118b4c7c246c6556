"""The tenancy layer's one error family.

The gateway maps these to HTTP in one table:

=============================  ====================================================
``AuthError``                  401, OpenAI ``code: invalid_api_key``
``LimiterUnavailableError``    503 (Redis unreachable under the ``fail_closed`` policy)
``TenancyConfigError``         start-up failure (never reaches a request)
``UnknownTenantError``         CLI misuse (``keys new --tenant nosuch``)
=============================  ====================================================

A refusal by the rate limiter is *not* an error: it is a :class:`tenancy.limiter.Decision`
value with ``admitted=False``.
"""

from __future__ import annotations


class TenancyError(Exception):
    """Base class of every error raised by ``tenancy``."""


class TenancyConfigError(TenancyError, ValueError):
    """The plans/tenants file is unreadable or invalid.

    The message starts with the dotted path of the bad field (``tenants.acme.plan: ...``),
    or keeps ``tomllib``'s ``(at line L, column C)`` for a syntax error.
    """


class AuthError(TenancyError):
    """The request carries no API key, a malformed one, or one that is unknown or revoked.

    The message is safe to show to the caller: it never contains the key itself.
    """


class LimiterUnavailableError(TenancyError):
    """Redis could not be reached (or did not answer in time) for a tenancy operation.

    Raised by the Redis-backed stores; the limiter turns it into a ``Decision`` according to
    its failure policy, so callers of ``Tenancy.admit`` see it only from ``authenticate``.
    """


class UnknownTenantError(TenancyError, LookupError):
    """A tenant name that the configuration does not define."""
