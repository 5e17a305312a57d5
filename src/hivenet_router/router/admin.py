"""The operator API under /admin/*, behind the administrator provider.

Errors about state (no such agent, a stale key version, a conflict) use the simple
`{"error": "..."}` shape operators of the Go router know; a request body that cannot be
used (too large, too slow, an invalid policy) gets the envelope every request error has.
The policy routes are in admin_policy.py, storage and the metrics reset in
admin_history.py, the registration stream in admin_stream.py, the answers' shapes in
admin_views.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from hivenet_router.auth.providers import AuthState, DynamicKeys, StaticKeys
from hivenet_router.auth.registry import DynamicKey, DynamicRegistry, RegistryError
from hivenet_router.clock import Clock
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.admin_history import HistoryApi
from hivenet_router.router.admin_policy import PolicyApi
from hivenet_router.router.admin_stream import RegistrationFeed
from hivenet_router.router.admin_views import health_entry, routing_entry
from hivenet_router.router.catalog import healthy, model_object
from hivenet_router.router.dispatch import Dispatcher
from hivenet_router.router.history import HistoryKeeper
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.requests import read_body
from hivenet_router.state.local import DailyCounter

log = logging.getLogger("hivenet.admin")
# Reads the site's daily totals from the store (sync/usage.py): day and this router's
# totals in, budget key to router ID to tokens out.
SiteUsage = Callable[[str, dict[str, int]], Awaitable[dict[str, dict[str, int]]]]
SITE_USAGE_TIMEOUT = 2.0  # seconds; past it the answer is this router's own totals

Handler = Callable[[Request], Awaitable[Answer]]


def _budgets(
    totals: dict[str, int], shares: dict[str, dict[str, int]] | None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key, used in sorted(totals.items()):
        tenant, _, model = key.partition("\x00")
        entry: dict[str, Any] = {"tenant": tenant, "model": model or None, "tokens_used": used}
        if shares is not None:
            entry["routers"] = dict(sorted(shares.get(key, {}).items()))
        out.append(entry)
    return out


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status)


class AdminApi:
    def __init__(
        self,
        *,
        registry: Registry,
        dispatcher: Dispatcher,
        policies: PolicyStore,
        clock: Clock,
        remove_agent: Callable[[AgentRecord], None],
        reload: Callable[[], Awaitable[dict[str, bool]]],
        daily: DailyCounter,
        auth: AuthState,
        history: HistoryKeeper,
        body_timeout: float = 30.0,
        sync_view: Callable[[], dict[str, Any]] | None = None,
        site_usage: SiteUsage | None = None,
        more: list[tuple[str, str, Handler]] | None = None,
        policy_written: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self.sync_view = sync_view
        self.site_usage = site_usage
        self.more = more or []  # routes of later layers (the wallets), wired in wiring.py
        self.history_api = HistoryApi(registry, history)
        # The registration stream follows the registry from here on; the process closes
        # it at shutdown.
        self.feed = RegistrationFeed(clock)
        registry.listen(self.feed.publish)
        self.policy_api = PolicyApi(policies, body_timeout, policy_written)
        self.body_timeout = body_timeout
        self.auth = auth
        self.daily = daily
        self.registry = registry
        self.dispatcher = dispatcher
        self.policies = policies
        self.clock = clock
        self.remove_agent = remove_agent
        self.reload = reload
        self.started = time.time()

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/admin/health", self.health),
            ("GET", "/admin/routing-table", self.routing_table),
            ("GET", "/admin/sync", self.sync),
            ("GET", "/admin/registration-stream", self.feed.serve),
            ("GET", "/admin/models", self.models),
            ("GET", "/admin/models/{model:.+}", self.model),
            *self.history_api.routes(),
            ("GET", "/admin/agents/{peer_id}", self.agent),
            ("POST", "/admin/agents/{peer_id}/drain", self.drain),
            ("POST", "/admin/agents/{peer_id}/undrain", self.undrain),
            ("DELETE", "/admin/agents/{peer_id}", self.remove),
            *self.policy_api.routes(),
            ("POST", "/admin/reload", self.reload_all),
            ("GET", "/admin/usage", self.usage),
            ("GET", "/admin/quotas", self.quotas),
            ("GET", "/admin/api-keys", self.keys_list),
            ("GET", "/admin/api-keys/version", self.keys_version),
            ("POST", "/admin/api-keys/replace", self.keys_replace),
            ("GET", "/admin/api-keys/{id}", self.key_get),
            ("PUT", "/admin/api-keys/{id}", self.key_put),
            ("DELETE", "/admin/api-keys/{id}", self.key_delete),
            *self.more,
        ]

    async def health(self, request: Request) -> Response:
        """The Go router's summary (status, counts, queue length, agents) and this router's
        per-model view, global queue and registration-stream subscribers."""
        agents = sorted(self.registry.all(), key=lambda a: a.peer_id)
        up = sum(1 for a in agents if healthy(a))
        pending = self.dispatcher.pending
        return _json(
            {
                "status": "healthy" if up else "degraded",
                "timestamp": int(self.clock.wall()),
                "total_agents": len(agents),
                "healthy_agents": up,
                "queue_length": pending.waiting,
                "agents": [health_entry(a) for a in agents],
                "uptime_seconds": round(time.time() - self.started, 1),
                "eligible_agents": sum(1 for a in agents if a.eligible),
                "models": self._model_loads(),
                "queue": {
                    "waiting": pending.waiting,
                    "forwarding": pending.forwarding,
                    "size": pending.size,
                    "limit": pending.limit,
                },
                "registration_stream": {
                    "subscribers": self.feed.subscribers,
                    "dropped": self.feed.dropped,
                },
            }
        )

    def _model_loads(self) -> dict[str, dict[str, int]]:
        return {
            model: {
                "agents": len(records),
                "eligible": sum(1 for a in records if a.eligible),
                "active_requests": sum(a.active for a in records),
                "capacity": sum(a.capacity for a in records),
                "waiting_for_capacity": self.dispatcher.queued(model),
            }
            for model, records in sorted(self.registry.models().items())
        }

    async def sync(self, request: Request) -> Response:
        """What this router knows of its site (--sync-store); {"enabled": false} alone."""
        if self.sync_view is None:
            return _json({"enabled": False})
        return _json({"enabled": True, **self.sync_view()})

    async def routing_table(self, request: Request) -> Response:
        now = self.clock.monotonic()
        agents = self.registry.all()
        return _json({"total": len(agents), "agents": [self._entry(a, now) for a in agents]})

    def _entry(self, record: AgentRecord, now: float) -> dict[str, Any]:
        """The routing table's entry with what routing learnt: breaker, adaptive limit,
        prefixes held."""
        settings = self.policies.current.for_model(record.model).breaker
        learnt = self.dispatcher.routing.agent_view(record.peer_id, settings)
        return routing_entry(record, now) | {"limit": record.limit, **learnt}

    async def models(self, request: Request) -> Response:
        """The whole catalog, as /v1/models shows it but unfiltered (`object`, `data`); the
        earlier answer, each model's agents keyed by model name, is kept beside it."""
        now = self.clock.monotonic()
        models = sorted(self.registry.models().items())
        by_name: dict[str, Any] = {
            model: [routing_entry(a, now) for a in records] for model, records in models
        }
        return _json(
            by_name
            | {
                "object": "list",
                "data": [model_object(model, records, detail=False) for model, records in models],
            }
        )

    async def model(self, request: Request) -> Response:
        name = request.match_info["model"]
        records = self.registry.for_model(name)
        if not records:
            return _json({"error": "model not registered"}, 404)
        now = self.clock.monotonic()
        return _json(
            model_object(name, records, detail=True)
            | {
                "model": name,
                "policy": self.policies.current.for_model(name).name,
                "routing_table": [routing_entry(a, now) for a in records],
            }
        )

    def _record(self, request: Request) -> AgentRecord | None:
        return self.registry.get(request.match_info["peer_id"])

    async def agent(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        return _json(routing_entry(record, self.clock.monotonic()))

    async def drain(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        if record.drain(True):  # no new requests; those in flight finish
            self.registry.announce("drained", record)
        return _json(
            {"peer_id": record.peer_id, "draining": True, "active_requests": record.active}
        )

    async def undrain(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        if record.drain(False):
            self.registry.announce("undrained", record)
        self.registry.changed(record.model)
        return _json({"peer_id": record.peer_id, "draining": False})

    async def remove(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        self.registry.remove(record.peer_id)
        self.remove_agent(record)
        return _json({"peer_id": record.peer_id, "removed": True})

    async def quotas(self, request: Request) -> Response:
        """Every key's limits (static or dynamic), without hashes, and today's use."""
        client = self.auth.client
        day, totals = self.daily.today()
        keys: list[dict[str, Any]] = []
        if isinstance(client, StaticKeys):
            for key in client.keys:
                entry = DynamicKey(
                    "",
                    key.digest,
                    key.preview,
                    key.owner,
                    key.name,
                    True,
                    key.expires_at,
                    "",
                    key.models,
                    key.quota,
                    key.max_occupancy_share,
                ).public()
                keys.append({k: v for k, v in entry.items() if k not in {"id", "key_hash"}})
        elif isinstance(client, DynamicKeys):
            keys = [entry.public() for entry in client.registry.entries()]
        for entry in keys:
            owner = entry["owner"]
            entry["tokens_used_today"] = {
                (key.partition("\x00")[2] or "*"): used
                for key, used in totals.items()
                if key.partition("\x00")[0] == owner
            }
        return _json({"mode": client.mode, "day": day, "keys": keys})

    async def usage(self, request: Request) -> Response:
        """Today's daily-token totals by budget (owner, or owner and model): this router's,
        or, with a site store, the site's with each router's share."""
        day, totals = self.daily.today()
        if self.site_usage is None:
            return _json({"day": day, "scope": "router", "budgets": _budgets(totals, None)})
        try:
            async with asyncio.timeout(SITE_USAGE_TIMEOUT):
                shares = await self.site_usage(day, totals)
        except Exception as error:  # the store is out: say so, and show what is known here
            log.warning("/admin/usage: the site store could not be read: %s", error)
            return _json(
                {
                    "day": day,
                    "scope": "router",
                    "site_error": "the site store could not be read; this router's totals only",
                    "budgets": _budgets(totals, None),
                }
            )
        site = {key: sum(by_router.values()) for key, by_router in shares.items()}
        return _json({"day": day, "scope": "site", "budgets": _budgets(site, shares)})

    # -- the dynamic key registry -----------------------------------------------------------------

    def _registry(self) -> DynamicRegistry:
        client = self.auth.client
        if not isinstance(client, DynamicKeys):
            raise RegistryError(501, "dynamic key registry not active")
        return client.registry

    async def _body(self, request: Request) -> Any:
        try:
            return orjson.loads(await read_body(request, self.body_timeout))
        except orjson.JSONDecodeError as exc:
            raise RegistryError(400, f"malformed JSON: {exc}") from None

    @staticmethod
    def _refused(exc: RegistryError) -> Response:
        return _json({"error": str(exc), **exc.extra}, exc.status)

    async def keys_list(self, request: Request) -> Response:
        try:
            registry = self._registry()
        except RegistryError as exc:
            return self._refused(exc)
        entries = registry.entries()
        return _json(
            {
                "count": len(entries),
                "keys": [e.public() for e in entries],
                "version": registry.version,
            }
        )

    async def keys_version(self, request: Request) -> Response:
        try:
            registry = self._registry()
        except RegistryError as exc:
            return self._refused(exc)
        return _json({"version": registry.version, "count": len(registry)})

    async def key_get(self, request: Request) -> Response:
        try:
            entry = self._registry().get(request.match_info["id"])
        except RegistryError as exc:
            return self._refused(exc)
        if entry is None:
            return _json({"error": f"key not found: {request.match_info['id'][:128]}"}, 404)
        return _json({"key": entry.public()})  # wrapped, as the reference answers

    async def key_put(self, request: Request) -> Response:
        try:
            registry = self._registry()
            registry.put(request.match_info["id"], await self._body(request))
        except RegistryError as exc:
            return self._refused(exc)
        return _json({"ok": True})

    async def key_delete(self, request: Request) -> Response:
        try:
            self._registry().delete(request.match_info["id"], request.query.get("version"))
        except RegistryError as exc:
            return self._refused(exc)
        return _json({"ok": True})

    async def keys_replace(self, request: Request) -> Response:
        try:
            registry = self._registry()
            count = registry.replace(await self._body(request))
        except RegistryError as exc:
            return self._refused(exc)
        return _json({"ok": True, "count": count})

    async def reload_all(self, request: Request) -> Response:
        """Reload policies and auth, as SIGHUP does; says what took effect."""
        result = await self.reload()
        return _json(result, 200 if all(result.values()) else 409)
