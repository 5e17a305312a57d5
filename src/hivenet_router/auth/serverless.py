"""The check that ties key limits to routing policies.

A key's serverless input rate (`input_tokens_per_minute`) charges the estimated prompt of
every request before it is forwarded. If that rate is below the `max_input_tokens` of a
serverless policy the key can reach, a prompt the policy admits can still never pass the
key's bucket: the key is configured to fail. The reference refuses such a configuration at
start, on reload and on dynamic key writes; so does this router.
"""

from __future__ import annotations

from collections.abc import Callable

from hivenet_router.auth.config import Quota
from hivenet_router.policy.store import PolicySet

# (key name, the models it may use (empty: all), its quota) -> what is wrong, or None.
KeyCheck = Callable[[str, frozenset[str], Quota], str | None]


def itpm_conflict(
    name: str, models: frozenset[str], quota: Quota, policies: PolicySet
) -> str | None:
    rate = quota.input_tokens_per_minute
    if not rate:
        return None
    if models:
        reachable = [(model, policies.for_model(model)) for model in sorted(models)]
    else:
        reachable = [("any model", policies.default), *sorted(policies.by_model.items())]
    for model, policy in reachable:
        if policy.mode == "serverless" and rate < policy.max_input_tokens:
            return (
                f"key {name}: input_tokens_per_minute {rate} is below max_input_tokens "
                f"{policy.max_input_tokens} of serverless policy {policy.name} ({model}); "
                "raise the rate to at least the policy's input limit"
            )
    return None


def no_check(name: str, models: frozenset[str], quota: Quota) -> str | None:
    return None
