"""Policy blocks: the sections of a policy document that a layer other than routing owns.

A layer declares a `Block` (its YAML key, its parser, its default, its part of the published
JSON Schema) in its own package and the process hands it to the policy store at start
(`router/wiring.py`); `policy/` never names it. The store parses each block present in a
document with the same `Reader` routing's own fields use, so a mistake names file, line and
field, and keeps what it parsed in `Policy.blocks`. The block object is also the typed key
that reads it back: `policy.block(CACHE)` is a `CacheSettings | None`, and a policy whose
document lacks the block gives the block's `default()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import yaml

    from hivenet_router.policy.reader import Reader

T_co = TypeVar("T_co", covariant=True)


class Block(Protocol[T_co]):
    """A named policy section: read, validated and described by the layer that owns it."""

    @property
    def name(self) -> str:
        """The top-level YAML key, e.g. `response_cache`."""
        ...

    def parse(self, reader: Reader, node: yaml.Node, where: str) -> T_co:
        """The value of the block's node; `where` is its path for errors (`reader.fail`)."""
        ...

    def default(self) -> T_co:
        """What a policy whose document lacks the block holds (None: the layer is off)."""
        ...

    def schema(self) -> dict[str, object]:
        """The block's part of the published JSON Schema (docs/policy.schema.json)."""
        ...


def check_names(blocks: Iterable[Block[Any]], taken: tuple[str, ...]) -> tuple[str, ...]:
    """The blocks' names, in order; refuses one given twice or one routing already uses."""
    names: list[str] = []
    for block in blocks:
        if block.name in taken or block.name in names:
            raise ValueError(f"policy block {block.name!r} is declared twice")
        names.append(block.name)
    return tuple(names)
