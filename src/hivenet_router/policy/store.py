"""The active policies: one global policy and per-model policies, replaced atomically.

A routing session takes one `PolicySet` snapshot and keeps it; a reload builds a new set and
swaps it in, so in-flight requests never see a half-applied change. Reload is conservative:
an invalid file keeps what it replaced, and the reason is logged.

The admin API may also replace the global policy or put and delete a named one; those
changes live in memory only, until the next reload or restart rebuilds the set from files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivenet_router.policy.blocks import Block, check_names
from hivenet_router.policy.document import BUILT_IN, TOP_FIELDS, Policy, parse_policy
from hivenet_router.policy.reader import PolicyError

log = logging.getLogger("hivenet.policy")


class PolicyConflict(PolicyError):
    """A valid document that cannot go in beside the rest: it claims a model another named
    policy claims, or a key's limits contradict it."""


DEFAULT_NAMES = ("_default.yaml", "_default.yml")


@dataclass(frozen=True, slots=True)
class PolicySet:
    """One immutable snapshot of every active policy."""

    default: Policy = BUILT_IN
    named: dict[str, Policy] = field(default_factory=dict)  # by document name
    by_model: dict[str, Policy] = field(default_factory=dict)

    def for_model(self, model: str) -> Policy:
        return self.by_model.get(model, self.default)


def _check_provider(policy: Policy, providers: frozenset[str]) -> None:
    provider = policy.fallback_provider
    if provider is not None and provider.engine not in providers:
        variable = f"HIVENET_ROUTER_{provider.engine.upper()}_API_KEY"
        raise PolicyError(
            f"{policy.source}: fallback_provider.engine: {provider.engine} needs {variable}, "
            "which was not set when the router started"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from None


class PolicyStore:
    """The active policies; `blocks` are the sections other layers own (`policy/blocks.py`),
    parsed from every document this store reads."""

    def __init__(
        self,
        policy_file: str = "",
        model_dir: str = "",
        providers: frozenset[str] = frozenset(),
        blocks: Sequence[Block[Any]] = (),
    ) -> None:
        check_names(blocks, TOP_FIELDS)  # a clash is refused at start, not at the first load
        self.blocks = tuple(blocks)
        self._providers = providers
        self._file = Path(policy_file) if policy_file else None
        self._dir = Path(model_dir) if model_dir else None
        self.current = PolicySet()
        self._rejected = 0  # files the reload under way refused (their policy kept or skipped)
        # Judges a candidate set against the rest of the configuration (the keys' limits);
        # set by whoever wires the router. A complaint keeps the current set.
        self.check: Callable[[PolicySet], str | None] = lambda candidate: None

    def load(self) -> None:
        """First load: any invalid policy file is fatal (raises PolicyError). The Go router
        skipped an invalid per-model file and served that model under the global policy,
        which an operator learns about only from a log line."""
        fresh = self._build(initial=True)
        problem = self.check(fresh)
        if problem is not None:
            raise PolicyError(problem)
        self.current = fresh

    def reload(self) -> bool:
        """SIGHUP: rebuild and swap; on a fatal problem keep the current set. True when every
        file took effect; False when the set was kept, or when a file was rejected and its
        policy kept as it was (or skipped) while the other files' changes took effect."""
        self._rejected = 0
        try:
            fresh = self._build(initial=False)
            problem = self.check(fresh)
            if problem is not None:
                raise PolicyError(problem)
        except PolicyError as exc:
            log.error("policy reload rejected, keeping the active policies: %s", exc)
            return False
        self.current = fresh
        log.info("policies reloaded: global %s, %d named", fresh.default.name, len(fresh.named))
        return not self._rejected

    # -- in-memory changes (the admin API) -----------------------------------------------------

    def parse(self, text: str, source: str, name: str, *, named: bool) -> Policy:
        """Validate one document exactly as a policy file is validated; changes nothing.
        Pure, so it may run off the event loop. Raises PolicyError."""
        policy = parse_policy(text, source, name, require_models=named, blocks=self.blocks)
        _check_provider(policy, self._providers)
        return policy

    def replace_default(self, policy: Policy) -> None:
        """Make `policy` the global policy. Raises PolicyConflict when the keys refuse it."""
        current = self.current
        self._install(PolicySet(policy, current.named, current.by_model))

    def put_named(self, policy: Policy) -> None:
        """Add or replace the named policy `policy.name`. Raises PolicyConflict when another
        named policy claims one of its models or the keys refuse it."""
        current = self.current
        taken = [
            model
            for model in policy.models
            if (other := current.by_model.get(model)) is not None and other.name != policy.name
        ]
        if taken:
            owner = current.by_model[taken[0]].name
            raise PolicyConflict(f"models: {', '.join(taken)} already claimed by policy {owner}")
        by_model = {m: p for m, p in current.by_model.items() if p.name != policy.name}
        by_model.update(dict.fromkeys(policy.models, policy))
        self._install(PolicySet(current.default, {**current.named, policy.name: policy}, by_model))

    def delete_named(self, name: str) -> bool:
        """Remove a named policy (its models fall back to the global one); False if absent.
        Raises PolicyConflict when the keys refuse what is left."""
        current = self.current
        if name not in current.named:
            return False
        named = {n: p for n, p in current.named.items() if n != name}
        by_model = {m: p for m, p in current.by_model.items() if p.name != name}
        self._install(PolicySet(current.default, named, by_model))
        return True

    def _install(self, candidate: PolicySet) -> None:
        problem = self.check(candidate)
        if problem is not None:
            raise PolicyConflict(problem)
        self.current = candidate

    # -- files ----------------------------------------------------------------------------------

    def _global(self, path: Path, name: str, initial: bool, previous: Policy) -> Policy:
        """A global policy file: fatal when invalid at start, kept as it was on reload."""
        try:
            policy = self.parse(_read(path), str(path), name, named=False)
        except PolicyError as exc:
            if initial:
                raise
            self._rejected += 1
            log.error("%s; keeping the previous global policy", exc)
            return previous
        return policy

    def _build(self, *, initial: bool) -> PolicySet:
        previous = self.current
        default = BUILT_IN
        if self._file is not None:
            default = self._global(self._file, "global", initial, previous.default)
        if self._dir is None:
            return PolicySet(default=default)
        if not self._dir.is_dir():
            raise PolicyError(f"{self._dir}: --policy-model-dir is not a directory")
        files = sorted(
            (p for p in self._dir.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()),
            key=lambda p: (p.stat().st_mtime, p.name),
        )
        named: dict[str, Policy] = {}
        for path in files:
            if path.name in DEFAULT_NAMES:
                default = self._global(path, "_default", initial, previous.default)
                if self._file is not None:
                    log.warning(
                        "%s replaces --policy-file %s as the global policy", path, self._file
                    )
                continue
            name = path.stem
            try:
                policy = self.parse(_read(path), str(path), name, named=True)
            except PolicyError as exc:
                if initial:
                    raise
                self._rejected += 1
                kept = previous.named.get(name)
                if kept is not None:
                    log.error("%s; keeping its previous version", exc)
                    named[name] = kept
                else:
                    log.error("%s; skipped", exc)
                continue
            named[name] = policy
        by_model: dict[str, Policy] = {}

        # Active files whose models did not change claim first, then edited ones, then new
        # ones, so an edit cannot steal a model from a file that still claims it; within
        # each group older files win (start-up order).
        def rank(name: str) -> tuple[bool, bool]:
            kept = previous.named.get(name)
            return kept is None, kept is None or kept.models != named[name].models

        for name in sorted(named, key=rank):
            policy = named[name]
            clash = [m for m in policy.models if m in by_model]
            if clash:
                if not initial:
                    self._rejected += 1
                owner = by_model[clash[0]].name
                kept = previous.named.get(name)
                if kept is not None and not any(m in by_model for m in kept.models):
                    # Like a file that became invalid: its previous version stays, and its
                    # models do not fall to the global policy unannounced.
                    log.error(
                        "%s claims %s, already claimed by %s; keeping its previous version",
                        policy.source,
                        ", ".join(clash),
                        owner,
                    )
                    named[name] = policy = kept
                else:
                    log.error(
                        "%s claims %s, already claimed by %s; the whole file is skipped",
                        policy.source,
                        ", ".join(clash),
                        owner,
                    )
                    del named[name]
                    continue
            for model in policy.models:
                by_model[model] = policy
        return PolicySet(default=default, named=named, by_model=by_model)
