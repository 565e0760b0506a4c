"""A base for list endpoints. Apart from ptcproject.api, which DRF's settings import: DRF's generic
views read those settings when they are defined."""

from typing import Any

from django.db.models import QuerySet
from rest_framework import generics, serializers


# A paginated list whose query parameters ``query_serializer`` checks (400 with field errors) and
# ``filter_rows`` applies to ``rows()``, the rows the caller may see. (A comment, not a docstring:
# drf-spectacular would publish a docstring as every subclass's description.)
class FilteredListApi(generics.ListAPIView):
    query_serializer: type[serializers.Serializer]

    def rows(self) -> QuerySet[Any]:
        raise NotImplementedError

    def filter_rows(self, rows: QuerySet[Any], query: dict[str, Any]) -> QuerySet[Any]:
        return rows

    def get_queryset(self) -> QuerySet[Any]:
        query = self.query_serializer(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        return self.filter_rows(self.rows(), query.validated_data)
