"""A layer adds a policy block without editing `policy/`: a toy block handed to a store of
its own is parsed from every document, read back typed, refused with file, line and field,
and described in the schema."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hivenet_router.policy.blocks import Block
from hivenet_router.policy.reader import PolicyError, Reader
from hivenet_router.policy.schema import policy_schema
from hivenet_router.policy.store import PolicyStore

ROUTING = "routing_policy: {strategy: least-loaded}\n"


@dataclass(frozen=True, slots=True)
class Shelf:
    size: int
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ShelfBlock:
    name: str = "shelf"

    def parse(self, reader: Reader, node: yaml.Node, where: str) -> Shelf:
        items = reader.mapping(node, where, ("size", "labels"))
        if "size" not in items:
            raise reader.fail(node, f"{where}.size", "is required")
        size = reader.count(items["size"], f"{where}.size")
        if size > 10:
            raise reader.fail(items["size"], f"{where}.size", "must be at most 10")
        labels = reader.strings(items["labels"], f"{where}.labels") if "labels" in items else ()
        return Shelf(size, labels)

    def default(self) -> Shelf:
        return Shelf(0)

    def schema(self) -> dict[str, object]:
        return {"type": "object", "properties": {"size": {"type": "integer", "maximum": 10}}}


SHELF = ShelfBlock()


def store(tmp_path: Path, text: str, blocks: tuple[Block[object], ...] = (SHELF,)) -> PolicyStore:
    (tmp_path / "shop.yaml").write_text(text)
    return PolicyStore(model_dir=str(tmp_path), blocks=blocks)


def test_a_layers_block_is_parsed_and_read_back_typed(tmp_path: Path) -> None:
    policies = store(tmp_path, f"models: [m]\n{ROUTING}shelf: {{size: 3, labels: [a, b]}}\n")
    policies.load()
    shelf: Shelf = policies.current.for_model("m").block(SHELF)
    assert shelf == Shelf(3, ("a", "b"))
    # The default policy's document is the built-in one: it lacks the block.
    assert policies.current.for_model("other").block(SHELF) == Shelf(0)


def test_its_mistakes_name_file_line_and_field(tmp_path: Path) -> None:
    policies = store(tmp_path, f"models: [m]\n{ROUTING}shelf:\n  size: 11\n")
    with pytest.raises(PolicyError, match=r"shop\.yaml:4: shelf\.size: must be at most 10$"):
        policies.load()
    with pytest.raises(PolicyError, match=r"^body:3: shelf\.colour: unknown field"):
        policies.parse(f"{ROUTING}shelf:\n  colour: red\n", "body", "x", named=False)
    with pytest.raises(PolicyError, match=r"^body:2: shelf\.size: is required"):
        policies.parse(f"{ROUTING}shelf: {{labels: [a]}}\n", "body", "x", named=False)


def test_a_store_without_the_block_refuses_its_key(tmp_path: Path) -> None:
    policies = store(tmp_path, f"models: [m]\n{ROUTING}shelf: {{size: 3}}\n", blocks=())
    with pytest.raises(PolicyError, match=r"shop\.yaml:3: policy\.shelf: unknown field"):
        policies.load()


def test_a_block_may_not_take_a_name_already_used() -> None:
    with pytest.raises(ValueError, match="'shelf' is declared twice"):
        PolicyStore(blocks=(SHELF, SHELF))
    with pytest.raises(ValueError, match="'routing_policy' is declared twice"):
        PolicyStore(blocks=(ShelfBlock("routing_policy"),))


def test_the_schema_carries_each_block_last_in_order() -> None:
    properties = policy_schema((SHELF,))["properties"]
    assert list(properties)[-1] == "shelf"
    assert properties["shelf"] == SHELF.schema()
    assert "shelf" not in policy_schema()["properties"]
