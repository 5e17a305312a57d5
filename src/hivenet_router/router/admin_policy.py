"""The policy routes of the admin API: read the active policies, and replace the global one
or put and delete a named one in memory.

A written policy is validated exactly as a policy file is (policy/document.py and the
provider and key checks of policy/store.py) and takes effect for the next request; it lasts
until the next reload (SIGHUP, POST /admin/reload) or restart, which rebuild the policies
from the files. An invalid document is a 400 whose message names the line and the field,
and changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from hivenet_router.domain.errors import ApiError, ErrorCode
from hivenet_router.http1.messages import Answer, Request, Response
from hivenet_router.policy.document import Policy, Step
from hivenet_router.policy.reader import PolicyError
from hivenet_router.policy.store import PolicyConflict, PolicyStore
from hivenet_router.router.admin_views import rfc3339
from hivenet_router.router.requests import read_body

Handler = Callable[[Request], Awaitable[Answer]]

MAX_POLICY_BYTES = 1 << 20  # a policy document sent to the admin API
MAX_NAME = 128
SOURCE = "body"  # how errors name the document: "body:3: routing_policy.strategy: ..."


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status)


def _step(step: Step) -> dict[str, Any]:
    return {
        "name": step.name,
        "match": dict(step.match.fields)
        | ({"tags": list(step.match.tags)} if step.match.tags else {}),
        "exclude_if": {g.signal: {g.op: g.threshold} for g in step.gates},
        "strategy": step.strategy,
        "max_tries": step.max_tries,
        **_options(step),
    }


def _options(step: Step) -> dict[str, Any]:
    """The options block the step's strategy reads, with the values in force (defaults
    included), under the name a policy document gives it; none for other strategies."""
    o = step.options
    if step.strategy == "prefix-affinity":
        return {"affinity": {"min_match": o.min_match, "max_imbalance": o.max_imbalance}}
    if step.strategy == "consistent-hash":
        return {"hash": {"key": o.hash_key, "header": o.hash_header, "load_factor": o.load_factor}}
    if step.strategy == "scored":
        scoring: dict[str, Any] = {"preset": o.preset}
        if o.weights:  # the overrides of the preset's weights, as written
            scoring["weights"] = dict(o.weights)
        if o.temperature is not None:
            scoring["temperature"] = o.temperature
        if o.costs:
            scoring["costs"] = [
                {
                    "match": dict(rule.fields) | ({"tags": list(rule.tags)} if rule.tags else {}),
                    "usd_per_million_tokens": rule.usd_per_million_tokens,
                }
                for rule in o.costs
            ]
        return {"scoring": scoring}
    if step.strategy == "predicted-latency":
        prediction: dict[str, Any] = {"max_imbalance": o.max_imbalance}
        if o.ttft_objective_ms is not None:
            prediction["ttft_objective_ms"] = o.ttft_objective_ms
        return {"prediction": prediction}
    return {}


def policy_json(policy: Policy) -> dict[str, Any]:
    provider = policy.fallback_provider
    return {
        "name": policy.name,
        "source": policy.source,
        "models": list(policy.models),
        "mode": policy.mode,
        "max_input_tokens": policy.max_input_tokens,
        "images_max": policy.images_max,
        "admit_budget_tokens": policy.admit_budget_tokens,
        "max_inflight": policy.max_inflight,
        "shed_if": {g.signal: {g.op: g.threshold} for g in policy.shed_if},
        "routing_policy": _step(policy.steps[0]),
        "fallback_chain": [_step(s) for s in policy.steps[1:]],
        "fallback_provider": {"engine": provider.engine, "model": provider.model}
        if provider
        else None,
    }


class PolicyApi:
    def __init__(
        self,
        policies: PolicyStore,
        body_timeout: float,
        written: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self.policies = policies
        self.body_timeout = body_timeout
        # Told of every write that was meant to apply (not a dry run), True when it did:
        # hivenet_policy_reload_total{trigger="api"}, as the reference counts it.
        self._written = written

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", "/admin/policy", self.policy),
            ("PUT", "/admin/policy", self.put_policy),
            ("GET", "/admin/policy/models", self.policy_models),
            ("GET", "/admin/policy/models/{name}", self.policy_model),
            ("PUT", "/admin/policy/models/{name}", self.put_policy_model),
            ("DELETE", "/admin/policy/models/{name}", self.delete_policy_model),
        ]

    # -- reading ------------------------------------------------------------------------------

    async def policy(self, request: Request) -> Response:
        return _json(policy_json(self.policies.current.default))

    async def policy_models(self, request: Request) -> Response:
        current = self.policies.current
        return _json({name: list(p.models) for name, p in sorted(current.named.items())})

    async def policy_model(self, request: Request) -> Response:
        policy = self.policies.current.named.get(request.match_info["name"])
        if policy is None:
            return _json({"error": "no such policy"}, 404)
        return _json(policy_json(policy))

    # -- writing ------------------------------------------------------------------------------

    async def put_policy(self, request: Request) -> Response:
        dry = _dry_run(request)
        policy = await self._counted(self._document(request, "global", named=False), dry)
        if dry:
            return _json({"status": "policy valid", "policy": policy_json(policy)})
        try:
            self.policies.replace_default(policy)
        except PolicyConflict as exc:
            self._written(False)
            return _json({"error": str(exc)}, 409)
        self._written(True)
        return _json({"status": "policy updated", "policy": policy_json(policy)})

    async def put_policy_model(self, request: Request) -> Response:
        name = _name(request)
        dry = _dry_run(request)
        policy = await self._counted(self._document(request, name, named=True), dry)
        if dry:
            return _json({"status": "policy valid", "name": name, "models": list(policy.models)})
        try:
            self.policies.put_named(policy)
        except PolicyConflict as exc:
            self._written(False)
            return _json({"error": str(exc)}, 409)
        self._written(True)
        return _json({"status": "policy updated", "name": name, "models": list(policy.models)})

    async def _counted(self, reading: Awaitable[Policy], dry: bool) -> Policy:
        """The document; a write refused for its body counts as a failed reload."""
        try:
            return await reading
        except ApiError:
            if not dry:
                self._written(False)
            raise

    async def delete_policy_model(self, request: Request) -> Response:
        name = _name(request)
        try:
            self.policies.delete_named(name)  # absent already: the same answer
        except PolicyConflict as exc:
            return _json({"error": str(exc)}, 409)
        return _json({"status": "policy deleted", "name": name})

    async def _document(self, request: Request, name: str, *, named: bool) -> Policy:
        """The body, validated as a policy file would be. Raises ApiError (400, 413)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_POLICY_BYTES:
            request.close = True  # the body is left unread
            raise _too_large()
        body = await read_body(request, self.body_timeout)
        if len(body) > MAX_POLICY_BYTES:
            raise _too_large()
        try:
            text = body.decode()
        except UnicodeDecodeError:
            raise ApiError(ErrorCode.REQUEST_INVALID, f"{SOURCE}: not UTF-8 text") from None
        try:
            # YAML parsing is pure Python and a document may be a megabyte: off the loop.
            policy = await asyncio.to_thread(self.policies.parse, text, SOURCE, name, named=named)
        except PolicyError as exc:
            raise ApiError(ErrorCode.REQUEST_INVALID, str(exc)) from None
        where = f"/admin/policy/models/{name}" if named else "/admin/policy"
        # When it was written, so an operator (and the console) can tell which version serves.
        return dataclasses.replace(
            policy, source=f"admin API (PUT {where} at {rfc3339(time.time())})"
        )


def _dry_run(request: Request) -> bool:
    """`?dry_run=true`: validate the document and say so, changing nothing (the console's
    Validate button). The checks against the other policies and the keys are made only
    when it is applied. A bare `?dry_run` is one too; a value that is neither true nor
    false is refused rather than read as false, which would apply what was only meant to
    be checked. Raises ApiError (400)."""
    value = request.query.get("dry_run")
    if value is None:
        return False
    flag = value.lower()
    if flag in _YES:
        return True
    if flag in _NO:
        return False
    raise ApiError(
        ErrorCode.REQUEST_INVALID,
        f"dry_run must be true or false, not {value[:40]!r}: nothing was changed",
        param="dry_run",
    )


_YES = frozenset({"", "1", "true"})
_NO = frozenset({"0", "false"})


def _name(request: Request) -> str:
    name = request.match_info["name"]
    if len(name) > MAX_NAME or not name.isprintable():
        raise ApiError(
            ErrorCode.REQUEST_INVALID,
            f"policy name: at most {MAX_NAME} printable characters",
        )
    return name


def _too_large() -> ApiError:
    return ApiError(
        ErrorCode.REQUEST_TOO_LARGE,
        f"a policy document is limited to {MAX_POLICY_BYTES} bytes",
    )
