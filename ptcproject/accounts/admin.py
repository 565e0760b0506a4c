from typing import Any

from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.forms import ReadOnlyPasswordHashWidget
from django.contrib.auth.models import Group, User
from django.db.models import F, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.utils.safestring import SafeString

from billing.models import LedgerEntry
from execution.admin import unended_kept
from execution.models import ExecJob, ExecSession, ToolCall
from ptcproject.accounts.authentication import signed_in_user
from ptcproject.accounts.models import ApiKey, ApiKeyEvent, UserSettings
from ptcproject.accounts.selectors import api_key_owner_allowed, api_key_owners
from ptcproject.accounts.services import api_key_create, api_key_expire, api_key_revoke, users_history_delete
from ptcproject.admin_deletes import CountedDeleteAdmin, pks_of
from ptcproject.admin_lists import LargeListAdmin
from ptcproject.admin_search import IndexedSearchAdmin
from ptcproject.errors import ApplicationError


class ApiKeyEventInline(admin.TabularInline):
    model = ApiKeyEvent
    fields = ("created_at", "action", "actor", "details")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(ApiKey)
class ApiKeyAdmin(IndexedSearchAdmin):
    list_display = ("prefix", "user", "name", "job", "created_at", "expires_at", "revoked_at", "last_used_at")
    list_filter = ("revoked_at", "expires_at", ("exec_job", admin.EmptyFieldListFilter))
    # A key a job (every job has one): matched whole, by their indexes (IndexedSearchAdmin); not the name.
    search_fields = ("prefix", "user__username")
    search_help_text = "A key's prefix (ptc_<prefix>_…) or a username, whole."
    readonly_fields = ("prefix", "exec_job", "created_at", "last_used_at", "revoked_at")
    fields = ("user", "name", "expires_at", "prefix", "exec_job", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke",)
    inlines = (ApiKeyEventInline,)
    autocomplete_fields = ("user",)  # a key's owner is searched for: a select drew every user

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiKey]:
        # The job's call id only: listed as a column, the job was joined whole, its code and output
        # (every job has a key: 100 keys were 200 MB a load of the list).
        return super().get_queryset(request).annotate(job_call_id=F("exec_job__call_id"))

    @admin.display(description="exec job", ordering="exec_job__call_id")
    def job(self, key: ApiKey) -> str:
        return key.job_call_id or "-"  # type: ignore[attr-defined]  # annotated by get_queryset

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> Any:
        # A key is its user's for life: moved to another user, whoever holds it would act as that
        # user, with no audit of the move. To give someone a key, make them one.
        if obj is None:
            return self.readonly_fields
        # A revoked key's expiry is refused by its service (conflict): offered, its change was
        # refused with an error, yet the page said the key was changed and its history recorded
        # "Changed Expires at" for a change that never happened.
        return (*self.readonly_fields, "user", *(("expires_at",) if obj.revoked_at is not None else ()))

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        # Offered, and taken: a POST naming anyone else is refused by the field ("Select a valid choice").
        if db_field.name == "user":
            kwargs["queryset"] = api_key_owners(actor=signed_in_user(request))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_change_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        # Another staff member's key, or a superuser's, is read-only to whoever may not make one for them.
        allowed = obj is None or api_key_owner_allowed(actor=signed_in_user(request), owner=obj.user)
        return allowed and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        # A key is revoked, never deleted, as over the API: a delete took its audit trail (who made
        # it, changed its expiry, revoked it) with it, and recorded nothing.
        return False

    def get_inlines(self, request: HttpRequest, obj: ApiKey | None) -> list[Any]:
        return list(self.inlines) if obj is not None else []  # a key being added has no history yet

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        actor = signed_in_user(request)
        if change:
            # The expiry goes through its service, so the change is audited like one made over the API.
            if "expires_at" in form.changed_data:
                try:
                    api_key_expire(key=obj, expires_at=obj.expires_at, actor=actor, source="admin")
                except ApplicationError as error:
                    messages.error(request, error.message)
                    return
            ApiKey.objects.filter(pk=obj.pk).update(name=obj.name)
            return
        key, plaintext = api_key_create(user=obj.user, name=obj.name, expires_at=obj.expires_at, actor=actor, source="admin")
        obj.pk, obj.prefix, obj.key_hash = key.pk, key.prefix, key.key_hash
        obj.plaintext = plaintext  # type: ignore[attr-defined]  # for response_add only; never stored

    def response_add(self, request: HttpRequest, obj: ApiKey, post_url_continue: str | None = None) -> HttpResponse:
        # The new key is shown in the answer to the POST that made it, and nowhere else: as a message
        # it sat in the messages cookie (signed, not encrypted) till the next page, and went out with
        # that page's request; with session storage it would sit in the database.
        context = {
            **self.admin_site.each_context(request),
            "title": "The new API key",
            "key": obj,
            "plaintext": obj.plaintext,  # type: ignore[attr-defined]  # set by save_model
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/accounts/apikey/created.html", context)

    @admin.action(description="Revoke the selected keys", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        actor = signed_in_user(request)
        keys = list(queryset.select_related("user"))
        mine = [key for key in keys if api_key_owner_allowed(actor=actor, owner=key.user)]
        for key in mine:
            api_key_revoke(key=key, actor=actor, source="admin")
        if mine:
            messages.success(request, f"Revoked {len(mine)} key(s).")
        if len(mine) < len(keys):
            messages.error(
                request,
                f"{len(keys) - len(mine)} key(s) of staff members or superusers were left as they are: "
                "only a superuser may revoke them.",
            )


@admin.register(UserSettings)
class UserSettingsAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("user", "retention_days", "max_concurrent_jobs", "max_concurrent_tool_calls", "max_jobs_per_minute")
    search_fields = ("user__username",)  # matched whole, by its index (IndexedSearchAdmin)
    search_help_text = "A username, whole."
    autocomplete_fields = ("user",)


admin.site.unregister(Group)


@admin.register(Group)
class PtcGroupAdmin(LargeListAdmin, GroupAdmin):
    """Django's group admin, whose permissions only a superuser may change: a member with "change
    group" could give a group they are in any permission, and so take it (PtcUserAdmin keeps them
    from joining one, not from filling their own)."""

    def get_readonly_fields(self, request: HttpRequest, obj: Group | None = None) -> Any:
        readonly = tuple(super().get_readonly_fields(request, obj))
        return readonly if signed_in_user(request).is_superuser else (*readonly, "permissions")


admin.site.unregister(User)


class PasswordSummary(ReadOnlyPasswordHashWidget):
    """The password's summary without Django's button to the password's page, for an account the
    member may not change: that page refuses them. Rendered from the project's templates (the
    form renderer's don't reach them)."""

    template_name = "admin/auth/user/password_summary.html"

    def render(self, name: str, value: Any, attrs: Any = None, renderer: Any = None) -> SafeString:
        return SafeString(render_to_string(self.template_name, self.get_context(name, value, attrs)))  # autoescaped


@admin.register(User)
class PtcUserAdmin(CountedDeleteAdmin, UserAdmin):
    """Django's user admin, that deletes no user with a job that has not ended, a tool call that is
    open or a session that is active: deleted, the user took them with them (a cascade), past the
    guard the job, call and session admins keep, and their workers recorded into rows gone under
    them.

    A member who is not a superuser may not make anyone more than they are: Django's own let anyone
    with "change user" tick is_superuser or is_staff, or grant groups and permissions, on any account
    their own among them, and a staff key may do all over the API. To them those four fields are
    read-only, and the accounts of other staff members and of superusers (api_key_owner_allowed, the
    rule of who may hold whose keys) are read-only whole: their page, their password's page, and
    their delete, one by one or in bulk. A superuser keeps it all."""

    ESCALATING_FIELDS = ("is_staff", "is_superuser", "groups", "user_permissions")
    # The ledger is append-only and kept for good (its entries are what the balance is, and what
    # was granted and charged): a user with one is not deleted, and the page says what to do.
    protected_because = {
        LedgerEntry: "credits were granted to or charged to this user, and the ledger is kept for good. "
        "Deactivate the user instead: untick Active on their page; they can no longer sign in, "
        "and their API keys stop working",
    }

    def get_readonly_fields(self, request: HttpRequest, obj: User | None = None) -> Any:
        # Read-only fields are left out of the form, so a crafted POST that sets them is ignored.
        readonly = tuple(super().get_readonly_fields(request, obj))
        return readonly if signed_in_user(request).is_superuser else (*readonly, *self.ESCALATING_FIELDS)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        fields = context["adminform"].form.fields  # this page's own form's
        if obj is not None and "password" in fields and not self.has_change_permission(request, obj):
            fields["password"].widget = PasswordSummary()
        return super().render_change_form(request, context, add, change, form_url, obj)

    def has_change_permission(self, request: HttpRequest, obj: User | None = None) -> bool:
        # Also held by the password's page (UserAdmin.user_change_password asks it of the user).
        allowed = obj is None or api_key_owner_allowed(actor=signed_in_user(request), owner=obj)
        return allowed and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: User | None = None) -> bool:
        allowed = obj is None or api_key_owner_allowed(actor=signed_in_user(request), owner=obj)
        return allowed and super().has_delete_permission(request, obj)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> tuple[QuerySet[Any], bool]:
        # The search for a new key's owner (the admin's autocomplete) finds only those the signed-in
        # member may make a key for, as its form takes only them.
        field = (request.GET.get("app_label"), request.GET.get("model_name"), request.GET.get("field_name"))
        if field == ("accounts", "apikey", "user"):
            queryset = queryset.filter(pk__in=api_key_owners(actor=signed_in_user(request)).values("pk"))
        return super().get_search_results(request, queryset, search_term)

    # Their history deleted a batch a statement first (users_history_delete): Django's delete did
    # each table in one statement, past PTC_DB_STATEMENT_TIMEOUT for a user of millions of calls.
    def delete_model(self, request: HttpRequest, obj: User) -> None:
        users_history_delete(user_ids=[obj.pk])
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[User]) -> None:
        users_history_delete(user_ids=pks_of(queryset))
        super().delete_queryset(request, queryset)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        ids = pks_of(objs)
        jobs, calls = ExecJob.objects.filter(user_id__in=ids), ToolCall.objects.filter(user_id__in=ids)
        sessions = ExecSession.objects.filter(user_id__in=ids)
        named, model_count, perms_needed, protected = super().get_deleted_objects(objs, request)
        # The delete action asks for the model's permission only: one user it may not delete is
        # enough to refuse the lot, as Django refuses it for a row of another model it may not delete.
        if get_user_model().objects.filter(pk__in=ids).exclude(pk__in=api_key_owners(actor=signed_in_user(request))).exists():
            perms_needed = {*perms_needed, self.model._meta.verbose_name}
        return unended_kept((named, model_count, perms_needed, protected), jobs=jobs, calls=calls, sessions=sessions)
