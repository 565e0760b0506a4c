"""A base for list endpoints. Apart from ptcproject.api, which DRF's settings import: DRF's generic
views read those settings when they are defined."""

from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db import connection
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from rest_framework import generics, serializers
from rest_framework.pagination import PageNumberPagination
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request


# A paginated list whose query parameters ``query_serializer`` checks (400 with field errors) and
# ``filter_rows`` applies to ``rows()``, the rows the caller may see. (A comment, not a docstring:
# drf-spectacular would publish a docstring as every subclass's description.)
#
# A page is sent as it is read, ``chunk_rows`` rows at a time (a row in parts where ``rendered``
# says so): the web holds one chunk of it, never the whole page. A page of 500 jobs, each with up
# to PTC_MAX_JOB_TOOL_BYTES of calls, was built whole in memory before a byte of it was sent: tens
# of gigabytes, from one user's own records. The answer is what DRF's paginated list gives (count,
# next, previous, results), in JSON only: an HTML page (DRF's browsable API) can't be written as
# it is read.
class FilteredListApi(generics.ListAPIView):
    query_serializer: type[serializers.Serializer]
    renderer_classes = [JSONRenderer]
    chunk_rows = 50

    def rows(self) -> QuerySet[Any]:
        raise NotImplementedError

    def filter_rows(self, rows: QuerySet[Any], query: dict[str, Any]) -> QuerySet[Any]:
        return rows

    def get_queryset(self) -> QuerySet[Any]:
        query = self.query_serializer(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        return self.filter_rows(self.rows(), query.validated_data)

    def rendered(self, rows: list[Any]) -> Iterator[bytes]:
        """``rows`` in JSON, each after a comma, in parts: all at once unless a list says otherwise."""
        for item in self.get_serializer(rows, many=True).data:
            yield b"," + JSONRenderer().render(item)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> StreamingHttpResponse:  # type: ignore[override]  # DRF takes any response
        rows = self.filter_queryset(self.get_queryset())
        # The page's ids, in the list's order: its rows are read a chunk at a time below.
        ids = list(self.paginate_queryset(rows.prefetch_related(None).values_list("pk", flat=True)) or [])
        paginator = self.paginator
        assert isinstance(paginator, PageNumberPagination)  # every list here is (DEFAULT_PAGINATION_CLASS)
        count = paginator.page.paginator.count if paginator.page is not None else 0
        head = JSONRenderer().render(
            {"count": count, "next": paginator.get_next_link(), "previous": paginator.get_previous_link()}
        )

        def parts() -> Iterator[bytes]:
            yield head[:-1] + b',"results":['
            first = True
            for at in range(0, len(ids), self.chunk_rows):
                chunk = ids[at : at + self.chunk_rows]
                found = {row.pk: row for row in rows.filter(pk__in=chunk)}  # one gone since is left out
                for part in self.rendered([found[pk] for pk in chunk if pk in found]):
                    if first and part:  # the first item's comma
                        part, first = part[1:], False
                    yield part
            yield b"]}"

        return json_streamed(request, parts())


def json_streamed(
    request: Request, parts: Iterator[bytes], *, status: int = 200, headers: dict[str, str] | None = None
) -> StreamingHttpResponse:
    """An answer in JSON sent as ``parts`` are made (each may read the database), rather than built
    whole first. Each part waits on the client, who may take its time: the database connection
    goes back to the pool before each (and if a read fails), not held from one part to the next."""

    def released() -> Generator[bytes, None, None]:
        try:
            for part in parts:
                _connection_release()
                if part:
                    yield part
        finally:
            _connection_release()

    content = _read_on_request_thread(released()) if isinstance(request._request, ASGIRequest) else released()
    return StreamingHttpResponse(content, content_type="application/json", status=status, headers=headers)


def _connection_release() -> None:
    """Give this thread's database connection back (to the pool), unless a transaction holds it
    (a test's): the next read takes one again."""
    if not connection.in_atomic_block:
        connection.close()


async def _read_on_request_thread(parts: Generator[bytes, None, None]) -> AsyncIterator[bytes]:
    """``parts`` for the event loop to send, each made on the request's thread, as the view was (its
    database connection, its context): Django would read a plain iterator to its end first. Closed
    there too when the client goes: its ``finally`` touches that thread's connection, which the
    event loop's thread must not (Django refuses it there)."""
    step = sync_to_async(lambda: next(parts, None), thread_sensitive=True)
    try:
        while (part := await step()) is not None:
            yield part
    finally:
        await sync_to_async(parts.close, thread_sensitive=True)()
