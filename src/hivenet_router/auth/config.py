"""auth.yaml: client keys for /v1/*, the administrator mode for /admin/*.

Parsed strictly: unknown fields, missing names or owners, malformed dates and duplicate key
hashes are errors naming the field. Administrator keys never live in this file; they come
from HIVENET_ROUTER_ADMIN_API_KEYS.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from hivenet_router.policy.reader import MAX_COUNT

API_MODES = ("none", "api-key", "dynamic")
ADMIN_MODES = ("none", "api-key")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DATE = re.compile(r"^(\d{2})-(\d{2})-(\d{4})$")


class AuthConfigError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ModelQuota:
    rpm_per_replica: int
    tokens_per_day: int


@dataclass(frozen=True, slots=True)
class Quota:
    """Limits of one key (0 means unlimited). `per_model`, when set, also lists the only
    models the key may use."""

    requests_per_minute: int = 0
    tokens_per_day: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    per_model: dict[str, ModelQuota] | None = None
    # The tenant's share in a model's wait queue against other tenants' (1: an equal share).
    queue_weight: float = 1.0


def _count(value: Any, where: str) -> int:
    # Bounded as the policy reader bounds its counts (policy/reader.py, MAX_COUNT): a
    # limit past 64 bits started the router, then failed every request of its key, the
    # key's gauges and with them all of /metrics, and /admin/quotas.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise AuthConfigError(f"{where}: must be an integer from 0 to {MAX_COUNT:.0e}")
    return value


def parse_quota(value: Any, where: str) -> Quota:
    flat_fields = (
        "requests_per_minute",
        "tokens_per_day",
        "input_tokens_per_minute",
        "output_tokens_per_minute",
    )
    raw = mapping(value, where, (*flat_fields, "per_model", "queue_weight"))
    weight = _weight(raw.get("queue_weight", 1.0), f"{where}.queue_weight")
    if "per_model" in raw:
        if any(f in raw for f in flat_fields):
            raise AuthConfigError(f"{where}: use either flat limits or per_model, not both")
        models = mapping(raw["per_model"], f"{where}.per_model", ())
        per_model = {}
        for model, entry in models.items():
            at = f"{where}.per_model.{model}"
            fields = mapping(entry, at, ("requests_per_minute_per_replica", "tokens_per_day"))
            for required in ("requests_per_minute_per_replica", "tokens_per_day"):
                if required not in fields:
                    raise AuthConfigError(f"{at}.{required}: is required")
            per_model[str(model)] = ModelQuota(
                _count(
                    fields["requests_per_minute_per_replica"],
                    f"{at}.requests_per_minute_per_replica",
                ),
                _count(fields["tokens_per_day"], f"{at}.tokens_per_day"),
            )
        return Quota(per_model=per_model, queue_weight=weight)
    limits = {f: _count(raw.get(f, 0), f"{where}.{f}") for f in flat_fields}
    return Quota(
        requests_per_minute=limits["requests_per_minute"],
        tokens_per_day=limits["tokens_per_day"],
        input_tokens_per_minute=limits["input_tokens_per_minute"],
        output_tokens_per_minute=limits["output_tokens_per_minute"],
        queue_weight=weight,
    )


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1000:
        raise AuthConfigError(f"{where}: must be a number above 0 and at most 1000")
    return float(value)


@dataclass(frozen=True, slots=True)
class ClientKey:
    digest: bytes
    preview: str
    name: str
    owner: str
    description: str = ""
    expires_at: float | None = None  # Unix time at which the key stops working
    models: frozenset[str] = frozenset()  # empty: every model
    quota: Quota = field(default_factory=Quota)
    max_occupancy_share: float = 0.0

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class AuthConfig:
    api_mode: str = "none"
    admin_mode: str | None = None  # None: not set in the file
    keys: tuple[ClientKey, ...] = ()


def _expiry(text: str, where: str) -> float | None:
    if not text:
        return None
    match = _DATE.match(text)
    if match is None:
        raise AuthConfigError(f"{where}: {text!r} is not a DD-MM-YYYY date")
    day, month, year = (int(g) for g in match.groups())
    try:
        start = calendar.timegm(time.struct_time((year, month, day, 0, 0, 0, 0, 0, 0)))
        time.strptime(text, "%d-%m-%Y")
    except ValueError:
        raise AuthConfigError(f"{where}: {text!r} is not a valid date") from None
    return float(start + 86400)  # valid through the whole named day (UTC)


def mapping(value: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AuthConfigError(f"{where}: must be a mapping")
    unknown = [k for k in value if allowed and k not in allowed]
    if unknown:
        raise AuthConfigError(
            f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(allowed)})"
        )
    return value


def _string(value: Any, where: str, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise AuthConfigError(f"{where}: {'must not be empty' if required else 'must be text'}")
    return value


# The most characters of a key's owner (its tenant) and name, as the reference's keygen
# bounds a tenant: it labels metric series and names a tenant in every record. (A tenant
# that owns a wallet takes at most 128: gateway/ledger_admin.MAX_TENANT.)
MAX_NAME = 200


def name_field(value: Any, where: str) -> str:
    """A key's owner or name: required, printable, at most MAX_NAME characters."""
    text = _string(value, where, required=True)
    if len(text) > MAX_NAME or not text.isprintable():
        raise AuthConfigError(f"{where}: at most {MAX_NAME} printable characters")
    return text


def occupancy_share(value: Any, where: str) -> float:
    """A key's `max_occupancy_share`; `where` names the field in errors."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise AuthConfigError(f"{where}: must be 0 (unset) or in (0, 1]")
    return float(value)


def parse_auth(text: str, source: str) -> AuthConfig:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AuthConfigError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise AuthConfigError(f"{source}: nested too deeply") from None
    root = mapping(document, source, ("api", "admin"))
    api = mapping(root.get("api"), f"{source}: api", ("mode", "keys"))
    admin = mapping(root.get("admin"), f"{source}: admin", ("mode",))
    api_mode = _string(api.get("mode", "none"), f"{source}: api.mode") or "none"
    if api_mode not in API_MODES:
        raise AuthConfigError(
            f"{source}: api.mode: {api_mode!r} is not one of {', '.join(API_MODES)}"
        )
    admin_mode = admin.get("mode")
    if admin_mode is not None and admin_mode not in ADMIN_MODES:
        raise AuthConfigError(
            f"{source}: admin.mode: {admin_mode!r} is not one of {', '.join(ADMIN_MODES)}"
        )
    raw_keys = api.get("keys") or []
    if not isinstance(raw_keys, list):
        raise AuthConfigError(f"{source}: api.keys: must be a list")
    if api_mode == "dynamic" and raw_keys:
        raise AuthConfigError(f"{source}: api.keys: dynamic mode takes no static keys")
    keys: list[ClientKey] = []
    seen: set[str] = set()
    for index, entry in enumerate(raw_keys):
        where = f"{source}: api.keys[{index}]"
        item = mapping(
            entry,
            where,
            ("key_hash", "key_preview", "metadata", "models", "quota", "max_occupancy_share"),
        )
        key_hash = _string(item.get("key_hash"), f"{where}.key_hash", required=True).lower()
        if not _HEX64.match(key_hash):
            raise AuthConfigError(
                f"{where}.key_hash: must be 64 hexadecimal characters "
                "(the SHA-256 printed by hivenet-router keygen)"
            )
        if key_hash in seen:
            raise AuthConfigError(f"{where}.key_hash: duplicate of an earlier key")
        seen.add(key_hash)
        meta = mapping(
            item.get("metadata"),
            f"{where}.metadata",
            ("name", "owner", "description", "created_at", "expires_at"),
        )
        models = item.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise AuthConfigError(f"{where}.models: must be a list of model names")
        quota = parse_quota(item.get("quota"), f"{where}.quota")
        if quota.per_model is not None:
            # Per-model quotas decide access themselves (an unlisted model is a 429 from
            # quota admission); the models list is then ignored.
            models = []
        keys.append(
            ClientKey(
                digest=bytes.fromhex(key_hash),
                preview=_string(item.get("key_preview"), f"{where}.key_preview"),
                name=name_field(meta.get("name"), f"{where}.metadata.name"),
                owner=name_field(meta.get("owner"), f"{where}.metadata.owner"),
                description=_string(meta.get("description"), f"{where}.metadata.description"),
                expires_at=_expiry(
                    _string(meta.get("expires_at"), f"{where}.metadata.expires_at"),
                    f"{where}.metadata.expires_at",
                ),
                models=frozenset(models),
                quota=quota,
                max_occupancy_share=occupancy_share(
                    item.get("max_occupancy_share"), f"{where}.max_occupancy_share"
                ),
            )
        )
    if api_mode == "api-key" and not keys:
        raise AuthConfigError(f"{source}: api.mode is api-key but api.keys is empty")
    return AuthConfig(api_mode=api_mode, admin_mode=admin_mode, keys=tuple(keys))
