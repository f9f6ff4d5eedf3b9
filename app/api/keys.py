"""API keys as the ingress holds them: SHA-256 digests, never the keys. A key given to `foreserve serve`
(``FORESERVE_API_KEYS``) travels to the replicas as its digest (``FORESERVE_API_KEY_SHA256``), so
neither Ray's dashboard nor a replica's environment shows it; a presented key is checked against
every digest in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def digest(key: str) -> str:
    """The hex SHA-256 of ``key`` (what a replica is given instead of the key)."""
    return hashlib.sha256(key.encode()).hexdigest()


def split_list(value: str | None) -> list[str]:
    """A comma-separated environment value as its non-empty, stripped items."""
    return [item.strip() for item in (value or "").split(",") if item.strip()]


class ApiKeys:
    """The accepted keys, by digest. Empty: no authentication."""

    def __init__(self, keys: Iterable[str] = (), digests: Iterable[str] = ()) -> None:
        self._digests = sorted({digest(k) for k in keys} | {d.lower() for d in digests})
        for d in self._digests:
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"an API key digest is 64 hex digits (SHA-256), got one of length {len(d)}")

    def __bool__(self) -> bool:
        return bool(self._digests)

    def tenant(self, presented: str) -> str | None:
        """The digest of ``presented`` if it is an accepted key (the caller's tenant), else None.
        Every digest is compared, each in constant time, so the time taken says nothing about which
        key or how much of one matched."""
        candidate = digest(presented)
        found = False
        for accepted in self._digests:
            found |= hmac.compare_digest(candidate.encode(), accepted.encode())
        return candidate if found else None

    def accepts(self, presented: str) -> bool:
        """``presented`` is an accepted key (``tenant``)."""
        return self.tenant(presented) is not None
