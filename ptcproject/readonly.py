"""An admin for records that services write and nobody edits: the books, the policy's history."""

from typing import Any

from django.http import HttpRequest

from ptcproject.admin_lists import LargeListAdmin


class ReadOnlyAdmin(LargeListAdmin):
    """Lists and shows its rows; adds, changes and deletes none."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
