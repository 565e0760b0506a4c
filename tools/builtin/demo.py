"""The ``demo`` toolset (PRODUCT.md): deterministic, for the quickstart, the tests and the benchmarks."""

import random
import time
from typing import Any

from tools.builtin import BuiltinTool, BuiltinToolset
from tools.errors import ToolFailure

MAX_SLEEP_MS = 60_000
CATEGORIES = ("jewelry", "watches", "accessories", "bags", "shoes", "eyewear")
_ADJECTIVES = ("Classic", "Modern", "Vintage", "Sport", "Elegant", "Urban", "Royal", "Minimal", "Bold", "Golden")
_NOUNS = {
    "jewelry": ("Necklace", "Ring", "Bracelet", "Earrings", "Pendant"),
    "watches": ("Chronograph", "Diver Watch", "Dress Watch", "Smartwatch", "Pilot Watch"),
    "accessories": ("Scarf", "Belt", "Wallet", "Tie", "Cufflinks"),
    "bags": ("Tote", "Backpack", "Clutch", "Messenger Bag", "Duffel"),
    "shoes": ("Sneaker", "Loafer", "Boot", "Sandal", "Oxford"),
    "eyewear": ("Sunglasses", "Reading Glasses", "Aviators", "Wayfarers", "Goggles"),
}


def _build_catalog() -> list[dict[str, Any]]:
    rng = random.Random(20261121)  # fixed seed: the catalog is the same in every process
    products: list[dict[str, Any]] = []
    for category in CATEGORIES:
        for adjective in _ADJECTIVES:
            for noun in _NOUNS[category][:4]:
                products.append(
                    {
                        "id": f"p{len(products) + 1:04d}",
                        "name": f"{adjective} {noun}",
                        "category": category,
                        "price": round(rng.uniform(9, 2500), 2),
                        "stock": rng.randint(0, 120),
                    }
                )
    return products


CATALOG = _build_catalog()


def echo(value: Any) -> Any:
    return value


def add(a: float, b: float) -> float:
    return a + b


def sleep(ms: int) -> dict[str, int]:
    time.sleep(ms / 1000)
    return {"slept_ms": ms}


def fail(message: str) -> Any:
    raise ToolFailure("tool_failed", message)


def catalog_search(query: str, category: str | None = None, limit: int = 10) -> list[dict[str, Any]]:
    words = set(query.lower().split())  # each word is looked for once, however often it is repeated
    hits = [
        p
        for p in CATALOG
        if (category is None or p["category"] == category) and all(w in f"{p['name']} {p['category']}".lower() for w in words)
    ]
    return hits[:limit]


_PRODUCT = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "name": {"type": "string"},
        "category": {"type": "string"},
        "price": {"type": "number"},
        "stock": {"type": "integer"},
    },
}

TOOLSET = BuiltinToolset(
    key="demo",
    name="Demo",
    description="Deterministic demo tools for trying PTC out.",
    price=1,
    tools=[
        BuiltinTool(
            name="echo",
            func=echo,
            description="Return the value unchanged.",
            input_schema={"type": "object", "properties": {"value": {}}, "required": ["value"]},
            billing_free=True,
        ),
        BuiltinTool(
            name="add",
            func=add,
            description="Add two numbers.",
            input_schema={
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            output_schema={"type": "number"},
        ),
        BuiltinTool(
            name="sleep",
            func=sleep,
            description=f"Wait for `ms` milliseconds (at most {MAX_SLEEP_MS}), then return {{slept_ms}}.",
            input_schema={
                "type": "object",
                "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": MAX_SLEEP_MS}},
                "required": ["ms"],
                "additionalProperties": False,
            },
            output_schema={"type": "object", "properties": {"slept_ms": {"type": "integer"}}},
        ),
        BuiltinTool(
            name="fail",
            func=fail,
            description="Always fail with `message`.",
            callable_from_code=True,
            input_schema={
                "type": "object",
                "properties": {"message": {"type": "string"}},
                "required": ["message"],
                "additionalProperties": False,
            },
        ),
        BuiltinTool(
            name="catalog_search",
            func=catalog_search,
            description="Search a fixed product catalog by words in the name, optionally in one category.",
            input_schema={
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 1000},
                    "category": {"type": "string", "enum": list(CATEGORIES)},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
            output_schema={"type": "array", "items": _PRODUCT},
        ),
    ],
)
