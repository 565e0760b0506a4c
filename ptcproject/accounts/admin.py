from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.services import api_key_create, api_key_revoke


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("prefix", "user", "name", "exec_job", "created_at", "expires_at", "revoked_at", "last_used_at")
    list_filter = ("revoked_at", "expires_at", ("exec_job", admin.EmptyFieldListFilter))
    search_fields = ("prefix", "user__username", "name")
    readonly_fields = ("prefix", "exec_job", "created_at", "last_used_at", "revoked_at")
    fields = ("user", "name", "expires_at", "prefix", "exec_job", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke",)

    def save_model(self, request: HttpRequest, obj: ApiKey, form: object, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        key, plaintext = api_key_create(user=obj.user, name=obj.name, expires_at=obj.expires_at)
        obj.pk, obj.prefix, obj.key_hash = key.pk, key.prefix, key.key_hash
        messages.warning(request, f"The new key, shown only this once: {plaintext}")

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for key in queryset:
            api_key_revoke(key=key)
        messages.success(request, f"Revoked {queryset.count()} key(s).")
