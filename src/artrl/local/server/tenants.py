"""Who is calling: the tenant a key belongs to (`--keys FILE`: one `TENANT KEY` line each; `#` comments).

A tenant sees and trains only its own models; the tenant `admin` sees every tenant's. Without a keys file
every caller is the tenant `default` (the server then listens on loopback only: config/server.py)."""

from __future__ import annotations

import hmac
import re
from pathlib import Path

ADMIN = "admin"
DEFAULT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Tenants:
    def __init__(self, keys: dict[str, str] | None) -> None:
        self._keys = keys  # key -> tenant (None: no keys, everyone is `default`)

    @classmethod
    def from_file(cls, path: str | None) -> Tenants:
        if path is None:
            return cls(None)
        keys: dict[str, str] = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not _NAME.fullmatch(parts[0]) or len(parts[1]) < 16:
                raise ValueError(
                    f"{path}:{number}: expected `TENANT KEY` (a tenant name of letters, digits, `_.-`, and a "
                    "key of at least 16 characters)"
                )
            if parts[1] in keys:
                raise ValueError(f"{path}:{number}: this key is already given to tenant {keys[parts[1]]!r}")
            keys[parts[1]] = parts[0]
        if not keys:
            raise ValueError(f"{path} holds no `TENANT KEY` line")
        return cls(keys)

    @property
    def keyed(self) -> bool:
        return self._keys is not None

    def tenant(self, key: str | None) -> str | None:
        """The tenant of `key` (None: no such key). Compared in constant time against every key."""
        if self._keys is None:
            return DEFAULT
        found = None
        for known, tenant in self._keys.items():
            if key is not None and hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found


def bearer(headers: dict[str, str]) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key` (Anthropic's)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given:
        return given
    return headers.get("x-api-key") or None
