"""Statements written out once, for the few reads and writes on every job's path, whose rows come
back as the model instances the ORM would have made.

On that path the ORM's cost is mostly Python: building the query, compiling it to SQL, choosing
its converters, 0.3-1 ms of CPU a statement, several times what PostgreSQL spends on it. A
statement here is a fixed string with parameters. Its rows go through the same converters the
ORM applies (JSON decoding, SQLite's dates and UUIDs, encrypted fields), so callers see what a
queryset would have given them. The SQL is plain enough for SQLite as well (RETURNING needs 3.35).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Field, Model

M = TypeVar("M", bound=Model)
T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
Converter = Callable[[Any, Any, Any], Any]


def table(model: type[Model]) -> str:
    """The model's table, quoted."""
    return _table(model, connection.vendor)


def columns(model: type[Model], alias: str = "") -> str:
    """Every concrete column of ``model``, in field order, quoted (and qualified by ``alias``): what
    ``from_row`` reads back."""
    return _columns(model, alias, connection.vendor)


# Written once per model and database: each ``connection.ops`` goes through Django's thread-local
# connection proxy, and a model's columns were dozens of those on every statement that named them.
@functools.cache
def _table(model: type[Model], vendor: str) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


@functools.cache
def _columns(model: type[Model], alias: str, vendor: str) -> str:
    prefix = f"{alias}." if alias else ""
    quote = connection.ops.quote_name
    return ", ".join(prefix + quote(str(field.column)) for field in model._meta.concrete_fields)


@functools.cache
def _converters(model: type[Model], vendor: str) -> tuple[tuple[int, tuple[Converter, ...], Any], ...]:
    """For each concrete field that has any, its index, the converters the ORM applies to its
    column on this database, and the expression they are given."""
    out = []
    for index, field in enumerate(model._meta.concrete_fields):
        col = field.get_col(model._meta.db_table)
        found = tuple(connection.ops.get_db_converters(col) + field.get_db_converters(connection))
        if found:
            out.append((index, found, col))
    return tuple(out)


def from_row(model: type[M], row: Sequence[Any], start: int = 0) -> M:
    """Return the instance of ``model`` whose columns (as ``columns`` lists them) begin at
    ``row[start]``, converted as the ORM converts them, and saved-state (not ``adding``)."""
    db = connections[DEFAULT_DB_ALIAS]  # once, not through the proxy for every converter
    count = len(model._meta.concrete_fields)
    values = list(row[start : start + count])
    for index, converters, col in _converters(model, db.vendor):
        value = values[index]
        for convert in converters:
            value = convert(value, col, db)
        values[index] = value
    return model.from_db(db.alias, (), values)  # field names are not read when every column is given


def prepared(instance: Model, fields: Sequence[Field]) -> list[Any]:
    """The values of ``instance``'s ``fields``, prepared as the ORM sends them to this database."""
    db = connections[DEFAULT_DB_ALIAS]
    return [field.get_db_prep_save(getattr(instance, field.attname), db) for field in fields]


def update_returning(model: type[M], *, pk: Any, status: str, values: dict[str, Any]) -> M | None:
    """Set ``values`` (field name to value, prepared as the ORM prepares them) on the row ``pk``
    if its ``status`` is ``status``, and return the row as stored after, or None if none matched:
    a conditional UPDATE and the read of its result in one statement."""
    fields = [field for name in values if isinstance(field := model._meta.get_field(name), Field)]
    assert len(fields) == len(values), "values names concrete fields only"
    db = connections[DEFAULT_DB_ALIAS]
    sets = ", ".join(f"{db.ops.quote_name(str(field.column))} = %s" for field in fields)
    params = [field.get_db_prep_save(value, db) for field, value in zip(fields, values.values(), strict=True)]
    sql = f"UPDATE {table(model)} SET {sets} WHERE id = %s AND status = %s RETURNING {columns(model)}"  # noqa: S608 - names from the model
    with db.cursor() as cursor:
        # As the ORM sends it: SQLite keeps a UUID as 32 hex digits, not as the text of a UUID.
        cursor.execute(sql, [*params, model._meta.pk.get_db_prep_value(pk, db), status])
        row = cursor.fetchone()
    return None if row is None else from_row(model, row)


def prefetched(instance: Model, name: str, related: list[Any]) -> None:
    """Give ``instance`` its ``name`` relation's rows, as ``prefetch_related(name)`` leaves them:
    ``instance.<name>.all()`` answers from ``related`` without a query."""
    queryset = getattr(instance, name).all()
    queryset._result_cache = related
    queryset._prefetch_done = True
    if not hasattr(instance, "_prefetched_objects_cache"):
        instance._prefetched_objects_cache = {}  # type: ignore[attr-defined]  # what prefetch_related fills
    instance._prefetched_objects_cache[name] = queryset  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Statement(Generic[T]):
    """A fixed statement that returns rows, its parameters, and what its rows make (``made``,
    given all of them). With ``sql`` empty, nothing is asked: ``made`` is given no rows."""

    sql: str
    params: Sequence[Any] | Mapping[str, Any]
    made: Callable[[list[tuple[Any, ...]]], T]

    def run(self) -> T:
        """Run it alone; return what its rows make."""
        if not self.sql:
            return self.made([])
        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)
            return self.made(cursor.fetchall())


@overload
def together(a: Statement[A], b: Statement[B], /) -> tuple[A, B]: ...
@overload
def together(a: Statement[A], b: Statement[B], c: Statement[C], /) -> tuple[A, B, C]: ...
def together(*statements: Statement[Any]) -> tuple[Any, ...]:
    """Run ``statements``, none of which needs another's result, and return what each one's rows
    make, in order.

    On PostgreSQL they go in one round trip (psycopg's pipeline mode: each statement waited for in
    turn cost a round trip of its own, 0.3-1 ms to a database over a network), in order, and
    outside ``atomic`` as one implicit transaction: an error in any undoes them all. Elsewhere
    (SQLite) they run one after another, each committed as it runs."""
    asked = [statement for statement in statements if statement.sql]
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or len(asked) < 2:
        return tuple(statement.run() for statement in statements)
    found = iter(db.pipelined([(statement.sql, statement.params) for statement in asked]))  # type: ignore[attr-defined]  # ptcproject.postgres
    return tuple(statement.made(next(found) if statement.sql else []) for statement in statements)
