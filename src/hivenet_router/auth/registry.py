"""The dynamic client-key registry: keys written at run time through /admin/api-keys/*.

Entries carry a SHA-256 hash, never the raw key. Every write names a registry version; a
version that sorts lower than the current one is stale and refused, so an external control
service can push changes without racing itself. The registry lives in memory: after a
restart, the control service repopulates it (POST /admin/api-keys/replace).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hivenet_router.auth.config import (
    AuthConfigError,
    Quota,
    mapping,
    name_field,
    occupancy_share,
    parse_quota,
)
from hivenet_router.auth.keys import digest

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
ENTRY_FIELDS = (
    "id",
    "version",
    "key_hash",
    "key_preview",
    "owner",
    "name",
    "enabled",
    "expires_at",
    "allowed_models",
    "quota",
    "max_occupancy_share",
)


class RegistryError(Exception):
    def __init__(self, status: int, message: str, **extra: str) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


@dataclass(frozen=True, slots=True)
class DynamicKey:
    id: str
    digest: bytes
    preview: str
    owner: str
    name: str
    enabled: bool
    expires_at: float | None
    expires_text: str
    models: frozenset[str]
    quota: Quota = field(default_factory=Quota)
    max_occupancy_share: float = 0.0

    def public(self) -> dict[str, Any]:
        """As listed by the admin API: the hash is never given back."""
        quota = self.quota
        return {
            "id": self.id,
            "key_hash": "",
            "key_preview": self.preview,
            "owner": self.owner,
            "name": self.name,
            "enabled": self.enabled,
            "expires_at": self.expires_text,
            "allowed_models": sorted(self.models),
            "quota": {
                "per_model": {
                    m: {
                        "requests_per_minute_per_replica": q.rpm_per_replica,
                        "tokens_per_day": q.tokens_per_day,
                    }
                    for m, q in quota.per_model.items()
                }
            }
            if quota.per_model is not None
            else {
                "requests_per_minute": quota.requests_per_minute,
                "tokens_per_day": quota.tokens_per_day,
                "input_tokens_per_minute": quota.input_tokens_per_minute,
                "output_tokens_per_minute": quota.output_tokens_per_minute,
            },
            "max_occupancy_share": self.max_occupancy_share,
        }


def parse_entry(key_id: str, body: Any) -> DynamicKey:
    """Validate one entry; raise RegistryError(400) naming the field."""
    try:
        item = mapping(body, "key", ENTRY_FIELDS)
        key_hash = item.get("key_hash")
        if not isinstance(key_hash, str) or not _HEX64.match(key_hash.lower()):
            raise AuthConfigError("key_hash: must be 64 hexadecimal characters (SHA-256)")
        for required in ("owner", "name"):
            if not isinstance(item.get(required), str) or not item[required].strip():
                raise AuthConfigError(f"{required}: is required")
            name_field(item[required], required)
        if not isinstance(item.get("enabled"), bool):
            raise AuthConfigError("enabled: is required (true or false)")
        expires_text = item.get("expires_at") or ""
        expires_at = None
        if expires_text:
            if not isinstance(expires_text, str):
                raise AuthConfigError("expires_at: must be an RFC 3339 timestamp")
            try:
                moment = datetime.datetime.fromisoformat(expires_text.replace("Z", "+00:00"))
            except ValueError:
                raise AuthConfigError("expires_at: must be an RFC 3339 timestamp") from None
            if moment.tzinfo is None:
                raise AuthConfigError("expires_at: needs a time zone (for example Z)")
            expires_at = moment.timestamp()
        models = item.get("allowed_models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise AuthConfigError("allowed_models: must be a list of model names")
        share = occupancy_share(item.get("max_occupancy_share"), "max_occupancy_share")
        quota = parse_quota(item.get("quota"), "quota")
    except AuthConfigError as exc:
        raise RegistryError(400, str(exc)) from None
    if quota.per_model is not None:
        models = []  # per-model quotas decide access, as in auth.yaml
    return DynamicKey(
        id=key_id,
        digest=bytes.fromhex(key_hash.lower()),
        preview=str(item.get("key_preview") or ""),
        owner=item["owner"],
        name=item["name"],
        enabled=item["enabled"],
        expires_at=expires_at,
        expires_text=expires_text,
        models=frozenset(models),
        quota=quota,
        max_occupancy_share=share,
    )


class DynamicRegistry:
    mode = "dynamic"

    def __init__(self, check: Callable[[DynamicKey], str | None] = lambda key: None) -> None:
        self._check = check
        self.version = ""
        self._by_id: dict[str, DynamicKey] = {}
        self._by_digest: dict[bytes, DynamicKey] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def _check_version(self, version: Any) -> str:
        if not isinstance(version, str) or not version:
            raise RegistryError(400, "version is required")
        if version < self.version:
            raise RegistryError(409, "stale version", current_version=self.version)
        return version

    def put(self, key_id: str, body: Any) -> None:
        version = self._check_version(body.get("version") if isinstance(body, dict) else None)
        entry = self._parse(key_id, body)
        owner = self._by_digest.get(entry.digest)
        if owner is not None and owner.id != key_id:
            raise RegistryError(409, f"key_hash already belongs to {owner.id}; delete it first")
        old = self._by_id.get(key_id)
        if old is not None:
            self._by_digest.pop(old.digest, None)
        self._by_id[key_id] = entry
        self._by_digest[entry.digest] = entry
        self.version = version

    def delete(self, key_id: str, version: Any) -> None:
        self.version = self._check_version(version)
        old = self._by_id.pop(key_id, None)
        if old is not None:
            self._by_digest.pop(old.digest, None)

    def replace(self, body: Any) -> int:
        if not isinstance(body, dict):
            raise RegistryError(400, "body must be a JSON object")
        version = self._check_version(body.get("version"))
        raw = body.get("keys")
        if not isinstance(raw, list):
            raise RegistryError(400, "keys: must be a list")
        by_id: dict[str, DynamicKey] = {}
        by_digest: dict[bytes, DynamicKey] = {}
        for index, item in enumerate(raw):
            key_id = item.get("id") if isinstance(item, dict) else None
            if not isinstance(key_id, str) or not key_id:
                raise RegistryError(400, f"keys[{index}].id: is required")
            if key_id in by_id:
                raise RegistryError(400, f"keys[{index}].id: duplicate id {key_id}")
            entry = self._parse(key_id, item)
            if entry.digest in by_digest:
                raise RegistryError(400, f"keys[{index}].key_hash: duplicate key hash")
            by_id[key_id] = entry
            by_digest[entry.digest] = entry
        self._by_id, self._by_digest, self.version = by_id, by_digest, version
        return len(by_id)

    def _parse(self, key_id: str, body: dict[str, Any]) -> DynamicKey:
        entry = parse_entry(key_id, {k: v for k, v in body.items() if k != "id"})
        problem = self._check(entry)
        if problem is not None:
            raise RegistryError(400, problem)
        return entry

    def get(self, key_id: str) -> DynamicKey | None:
        return self._by_id.get(key_id)

    def entries(self) -> list[DynamicKey]:
        # One snapshot of the map: a policy reload reads this on a worker thread while
        # the event loop may add or delete keys.
        by_id = self._by_id.copy()
        return [by_id[k] for k in sorted(by_id)]

    def find(self, credential: str, now: float) -> DynamicKey | None:
        # Indexed by digest: the lookup's timing depends only on the SHA-256 of what the
        # caller sent, which reveals nothing about any valid key.
        entry = self._by_digest.get(digest(credential))
        if entry is None or not entry.enabled:
            return None
        if entry.expires_at is not None and now >= entry.expires_at:
            return None
        return entry
