"""Who is calling: the client provider for /v1/*, the administrator provider for /admin/*.

The two never share credentials: a client key opens no admin route and an admin key no
client route. The active providers live in one `AuthState`, swapped whole on SIGHUP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hivenet_router.auth.config import (
    API_MODES,
    AuthConfig,
    AuthConfigError,
    ClientKey,
    Quota,
    parse_auth,
)
from hivenet_router.auth.keys import DigestSet, digest
from hivenet_router.auth.registry import DynamicRegistry
from hivenet_router.auth.serverless import KeyCheck, no_check

log = logging.getLogger("hivenet.auth")


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key_id: str
    name: str
    models: frozenset[str]  # empty: every model
    quota: Quota = Quota()
    occupancy_share: float = 0.0

    @property
    def key_ref(self) -> str:
        """Identifies the key for per-key (serverless) limits. Static keys have no registry
        ID, so their owner and name stand in (the Go router let them share one bucket)."""
        return self.key_id or f"{self.tenant}/{self.name}"

    def allows(self, model: str) -> bool:
        """May this key send requests for `model`? (A 403 when not.)"""
        return not self.models or model in self.models

    def sees(self, model: str) -> bool:
        """Does discovery show `model` to this key? Per-model quotas also hide what they
        do not list."""
        return self.allows(model) and self.declares(model)

    def declares(self, model: str) -> bool:
        """False when the key has per-model quotas and none for `model` (a 429)."""
        per_model = self.quota.per_model
        return per_model is None or model in per_model


ANONYMOUS = Principal("default", "anonymous", "", frozenset())


class ClientAuth(Protocol):
    mode: str

    def authenticate(self, credential: str | None, now: float) -> Principal | None: ...


class OpenAccess:
    mode = "none"

    def authenticate(self, credential: str | None, now: float) -> Principal | None:
        return ANONYMOUS


class StaticKeys:
    mode = "api-key"

    def __init__(self, keys: tuple[ClientKey, ...]) -> None:
        self.keys = keys
        self._keys = DigestSet({key.digest: key for key in keys})

    def authenticate(self, credential: str | None, now: float) -> Principal | None:
        if not credential:
            return None
        key = self._keys.find(credential)
        if not isinstance(key, ClientKey) or key.expired(now):
            return None
        return Principal(key.owner, "", key.name, key.models, key.quota, key.max_occupancy_share)


class DynamicKeys:
    """Client authentication against the dynamic registry."""

    mode = "dynamic"

    def __init__(self, registry: DynamicRegistry) -> None:
        self.registry = registry

    def authenticate(self, credential: str | None, now: float) -> Principal | None:
        if not credential:
            return None
        entry = self.registry.find(credential, now)
        if entry is None:
            return None
        return Principal(
            entry.owner, entry.id, entry.name, entry.models, entry.quota, entry.max_occupancy_share
        )


class AdminKeys:
    def __init__(self, raw_keys: tuple[str, ...]) -> None:
        self.mode = "api-key" if raw_keys else "none"
        self._keys = DigestSet({digest(k): True for k in raw_keys})

    def authenticate(self, credential: str | None) -> bool:
        if self.mode == "none":
            return True
        return bool(credential) and self._keys.find(credential or "") is not None


@dataclass(frozen=True, slots=True)
class AuthSettings:
    file: str
    env_mode: str
    admin_keys: tuple[str, ...]
    allow_insecure_admin: bool


class AuthState:
    """The active providers. `reload` builds new ones and swaps them, or keeps the old ones
    and says why. `check` judges every key against the routing policies (static keys when
    loaded, dynamic keys when written)."""

    def __init__(self, settings: AuthSettings, check: KeyCheck = no_check) -> None:
        self.settings = settings
        self.check = check
        self.client, self.admin = self._build()

    def conflict(self, check: KeyCheck) -> str | None:
        """The first active key that `check` refuses, if any."""
        client = self.client
        keys: list[tuple[str, frozenset[str], Quota]] = []
        if isinstance(client, StaticKeys):
            keys = [(k.name, k.models, k.quota) for k in client.keys]
        elif isinstance(client, DynamicKeys):
            keys = [(k.id, k.models, k.quota) for k in client.registry.entries()]
        for name, models, quota in keys:
            problem = check(name, models, quota)
            if problem is not None:
                return problem
        return None

    def _config(self) -> AuthConfig:
        if not self.settings.file:
            return AuthConfig(api_mode=self.settings.env_mode or "none")
        try:
            text = Path(self.settings.file).read_text()
        except OSError as exc:
            raise AuthConfigError(f"{self.settings.file}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise AuthConfigError(
                f"{self.settings.file}: not UTF-8 text (byte {exc.start}): {exc.reason}"
            ) from None
        return parse_auth(text, self.settings.file)

    def _build(self) -> tuple[ClientAuth, AdminKeys]:
        config = self._config()
        client: ClientAuth
        if config.api_mode == "none":
            client = OpenAccess()
        elif config.api_mode == "api-key":
            if not config.keys:
                raise AuthConfigError(
                    "api-key mode needs keys; use an auth.yaml file "
                    "(--auth-config-file) with api.keys"
                )
            for key in config.keys:
                problem = self.check(key.name, key.models, key.quota)
                if problem is not None:
                    raise AuthConfigError(problem)
            client = StaticKeys(config.keys)
        elif config.api_mode == "dynamic":
            # The registry survives reloads: only a restart empties it.
            current = getattr(self, "client", None)
            registry = (
                current.registry
                if isinstance(current, DynamicKeys)
                else DynamicRegistry(lambda key: self.check(key.id, key.models, key.quota))
            )
            client = DynamicKeys(registry)
        else:
            # Never a default: a mistyped mode must not quietly pick one (a typo once meant
            # dynamic, whose admin-key guard below then did not apply).
            raise AuthConfigError(
                f"api mode {config.api_mode!r} is not one of {', '.join(API_MODES)}"
            )
        admin = AdminKeys(self.settings.admin_keys)
        wanted = config.admin_mode or admin.mode
        if config.api_mode == "dynamic":
            # The registry is written through /admin/*: it must never be open.
            if admin.mode == "none":
                raise AuthConfigError("api.mode dynamic needs HIVENET_ROUTER_ADMIN_API_KEYS")
            wanted = "api-key"
        if wanted == "api-key" and admin.mode == "none":
            raise AuthConfigError(
                "admin.mode is api-key but HIVENET_ROUTER_ADMIN_API_KEYS is empty"
            )
        if wanted == "none":
            if not self.settings.allow_insecure_admin:
                raise AuthConfigError(
                    "/admin/* would be open to anyone: set HIVENET_ROUTER_ADMIN_API_KEYS, or "
                    "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true for isolated development only"
                )
            admin = AdminKeys(())
        return client, admin

    def reload(self) -> bool:
        try:
            client, admin = self._build()
        except AuthConfigError as exc:
            log.error("auth reload rejected, keeping the active providers: %s", exc)
            return False
        if client.mode != self.client.mode:
            log.error(
                "auth reload rejected: switching api.mode from %s to %s needs a restart",
                self.client.mode,
                client.mode,
            )
            return False
        self.client, self.admin = client, admin
        log.info("auth reloaded (api.mode %s)", client.mode)
        return True
