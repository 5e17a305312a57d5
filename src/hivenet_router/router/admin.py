"""The operator API under /admin/*, behind the administrator provider.

Errors here use the simple `{"error": "..."}` shape operators of the Go router know.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson

from hivenet_router.auth.providers import AuthState, DynamicKeys, StaticKeys
from hivenet_router.auth.registry import DynamicKey, DynamicRegistry, RegistryError
from hivenet_router.clock import Clock
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.policy.document import Policy, Step
from hivenet_router.policy.store import PolicyStore
from hivenet_router.router.dispatch import Dispatcher
from hivenet_router.router.registry import AgentRecord, Registry
from hivenet_router.router.requests import read_body
from hivenet_router.state.local import DailyCounter

Handler = Callable[[Request], Awaitable[Answer]]


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status)


def _agent(record: AgentRecord, now: float) -> dict[str, Any]:
    return {
        "peer_id": record.peer_id,
        "metadata": msgspec.to_builtins(record.reg),
        "health": {
            "connected": record.connected,
            "process_healthy": record.process_healthy,
            "backend_healthy": record.backend_healthy,
            "draining": record.draining,
            "eligible": record.eligible,
            "seconds_since_heartbeat": round(now - record.last_heartbeat, 3),
        },
        "capacity": record.capacity,
        "active_requests": record.active,
        "history": {
            "successes": record.successes,
            "failures": record.failures,
            "consecutive_failures": record.consecutive_failures,
            "srtt_ms": record.srtt_ms,
            "rttvar_ms": record.rttvar_ms,
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "disconnects": record.disconnects,
            "health_failures": record.health_failures,
        },
        "engine": msgspec.to_builtins(record.engine) if record.engine else None,
        "hardware": msgspec.to_builtins(record.hardware) if record.hardware else None,
    }


def _step(step: Step) -> dict[str, Any]:
    return {
        "name": step.name,
        "match": dict(step.match.fields)
        | ({"tags": list(step.match.tags)} if step.match.tags else {}),
        "exclude_if": {g.signal: {g.op: g.threshold} for g in step.gates},
        "strategy": step.strategy,
        "max_tries": step.max_tries,
    }


def _policy(policy: Policy) -> dict[str, Any]:
    provider = policy.fallback_provider
    return {
        "name": policy.name,
        "source": policy.source,
        "models": list(policy.models),
        "routing_policy": _step(policy.steps[0]),
        "fallback_chain": [_step(s) for s in policy.steps[1:]],
        "fallback_provider": {"engine": provider.engine, "model": provider.model}
        if provider
        else None,
    }


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
        body_timeout: float = 30.0,
    ) -> None:
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
            ("GET", "/admin/models", self.models),
            ("GET", "/admin/models/{model:.+}", self.model),
            ("GET", "/admin/agents/{peer_id}", self.agent),
            ("POST", "/admin/agents/{peer_id}/drain", self.drain),
            ("POST", "/admin/agents/{peer_id}/undrain", self.undrain),
            ("DELETE", "/admin/agents/{peer_id}", self.remove),
            ("GET", "/admin/policy", self.policy),
            ("GET", "/admin/policy/models", self.policy_models),
            ("GET", "/admin/policy/models/{name}", self.policy_model),
            ("POST", "/admin/reload", self.reload_all),
            ("GET", "/admin/usage", self.usage),
            ("GET", "/admin/quotas", self.quotas),
            ("GET", "/admin/api-keys", self.keys_list),
            ("GET", "/admin/api-keys/version", self.keys_version),
            ("POST", "/admin/api-keys/replace", self.keys_replace),
            ("GET", "/admin/api-keys/{id}", self.key_get),
            ("PUT", "/admin/api-keys/{id}", self.key_put),
            ("DELETE", "/admin/api-keys/{id}", self.key_delete),
        ]

    async def health(self, request: Request) -> Response:
        agents = self.registry.all()
        models = self.registry.models()
        pending = self.dispatcher.pending
        return _json(
            {
                "status": "ok",
                "uptime_seconds": round(time.time() - self.started, 1),
                "agents": len(agents),
                "eligible_agents": sum(1 for a in agents if a.eligible),
                "models": {
                    model: {
                        "agents": len(records),
                        "eligible": sum(1 for a in records if a.eligible),
                        "active_requests": sum(a.active for a in records),
                        "capacity": sum(a.capacity for a in records),
                        "waiting_for_capacity": self.dispatcher.queued(model),
                    }
                    for model, records in sorted(models.items())
                },
                "queue": {"waiting": pending.waiting, "forwarding": pending.forwarding},
            }
        )

    async def routing_table(self, request: Request) -> Response:
        now = self.clock.monotonic()
        return _json({"agents": [_agent(a, now) for a in self.registry.all()]})

    async def models(self, request: Request) -> Response:
        now = self.clock.monotonic()
        return _json(
            {
                model: [_agent(a, now) for a in records]
                for model, records in sorted(self.registry.models().items())
            }
        )

    async def model(self, request: Request) -> Response:
        records = self.registry.for_model(request.match_info["model"])
        if not records:
            return _json({"error": "model not registered"}, 404)
        now = self.clock.monotonic()
        return _json(
            {
                "model": request.match_info["model"],
                "policy": self.policies.current.for_model(request.match_info["model"]).name,
                "agents": [_agent(a, now) for a in records],
            }
        )

    def _record(self, request: Request) -> AgentRecord | None:
        return self.registry.get(request.match_info["peer_id"])

    async def agent(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        return _json(_agent(record, self.clock.monotonic()))

    async def drain(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        record.draining = True  # no new requests; those in flight finish
        return _json(
            {"peer_id": record.peer_id, "draining": True, "active_requests": record.active}
        )

    async def undrain(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        record.draining = False
        self.registry.changed(record.model)
        return _json({"peer_id": record.peer_id, "draining": False})

    async def remove(self, request: Request) -> Response:
        record = self._record(request)
        if record is None:
            return _json({"error": "no such agent"}, 404)
        self.registry.remove(record.peer_id)
        self.remove_agent(record)
        return _json({"peer_id": record.peer_id, "removed": True})

    async def policy(self, request: Request) -> Response:
        return _json(_policy(self.policies.current.default))

    async def policy_models(self, request: Request) -> Response:
        current = self.policies.current
        return _json({name: list(p.models) for name, p in sorted(current.named.items())})

    async def policy_model(self, request: Request) -> Response:
        policy = self.policies.current.named.get(request.match_info["name"])
        if policy is None:
            return _json({"error": "no such policy"}, 404)
        return _json(_policy(policy))

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
        """Today's daily-token totals by budget (owner, or owner and model)."""
        day, totals = self.daily.today()
        buckets = []
        for key, used in sorted(totals.items()):
            tenant, _, model = key.partition("\x00")
            buckets.append({"tenant": tenant, "model": model or None, "tokens_used": used})
        return _json({"day": day, "budgets": buckets})

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
            return _json({"error": "no such key"}, 404)
        return _json(entry.public())

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
