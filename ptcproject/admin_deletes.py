"""The admin's delete pages, counted rather than read (ptcproject.deletion)."""

from collections.abc import Callable
from functools import partial, wraps
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.actions import delete_selected
from django.db import OperationalError, router, transaction
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from ptcproject.admin_lists import LargeListAdmin
from ptcproject.db import deadlocked, statement_cancelled
from ptcproject.deletion import deletion_counts, deletion_lock

OBJECTS_NAMED = 100  # of the rows chosen for a delete, the most its page names


def _stopped_because(exc: OperationalError) -> str | None:
    """Return why PostgreSQL stopped a delete, the transaction rolled back whole, when trying it
    again may go through; None for any other error."""
    if deadlocked(exc):
        # A delete locks its rows, then the rows they name (deletion_lock), then deletes their
        # history; a write that takes such rows the other way round (a charge: the account, then a
        # usage row naming the user) may meet it half way, whichever order the delete chose.
        return "it and a write under way to the same rows (a charge, say) were each waiting on the other, and one had to give way"
    if statement_cancelled(exc):
        # PTC_DB_STATEMENT_TIMEOUT's statement or lock timeout: a row held locked by a transaction
        # that does not end (a stuck one), or a statement slower than it.
        return (
            "it ran, or waited on rows another transaction holds locked, longer than the database allows a "
            "statement (PTC_DB_STATEMENT_TIMEOUT; stopped again, a transaction may be stuck holding them: "
            "see pg_stat_activity)"
        )
    return None


def _or_try_again(request: HttpRequest, delete: Callable[[], Any], again: Any) -> Any:
    """Return what ``delete`` (a delete page's or action's work, in one transaction) returns; or
    ``again``, with a message saying why and to try again, if PostgreSQL stopped it as
    _stopped_because says (rolled back whole: nothing deleted). Raised, the delete was a 500."""
    try:
        return delete()
    except OperationalError as exc:
        why = _stopped_because(exc)
        if why is None:
            raise
        messages.error(request, f"The database stopped this delete: {why}. Nothing was deleted: try again.")
        return again


# The fields of the delete action's confirmation besides a key a row chosen: its CSRF token, its
# action and its "post".
CONFIRMATION_FIELDS = 3


def chosen_max() -> int:
    """Return the most rows the delete action deletes at once: its confirmation posts back each
    one's key, a field of its own, and Django refuses a form of more than DATA_UPLOAD_MAX_NUMBER_FIELDS
    (a 400, once confirmed). Over 65,535 rows ("Select all" of a large list), the keys, each a
    parameter of one pk__in, were past PostgreSQL's bound on a statement's: every query that named
    them failed (a 500, before the confirmation)."""
    return settings.DATA_UPLOAD_MAX_NUMBER_FIELDS - CONFIRMATION_FIELDS


@wraps(delete_selected)
def delete_selected_at_once(modeladmin: Any, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
    """Django's delete action in one transaction, as its delete page runs: its check (under the
    rows' lock, CountedDeleteAdmin.get_deleted_objects) and its delete, all or nothing. Run as a
    statement a transaction, a delete refused late, or cut off part way (a user's history deleted
    a batch a statement first), left what was done deleted and the rest kept."""

    def delete() -> Any:
        with transaction.atomic(using=router.db_for_write(modeladmin.model)):
            # The rows chosen by their keys, read once: the confirmation counts them and posts back
            # the same. Its keys were the list's rows read again as the page was drawn, and a row
            # written between (a job ended, in a list of ended jobs: "Select all") was deleted uncounted.
            most = chosen_max()
            keys = list(queryset.values_list("pk", flat=True)[: most + 1])
            if len(keys) > most:  # refused before anything is counted, locked or deleted
                name = queryset.model._meta.verbose_name_plural
                modeladmin.message_user(
                    request,
                    f"Nothing was deleted: more than {most:,} {name} were selected, and the delete action takes at "
                    f"most {most:,} at a time. Narrow the list (a filter, a search) to that many and delete them, then the next.",
                    messages.ERROR,
                )
                return None
            return delete_selected(modeladmin, request, modeladmin.chosen_rows(keys))

    return _or_try_again(request, delete, None)  # None: back to the list, its message shown


def pks_of(objs: Any) -> list[Any]:
    """The primary keys of ``objs``, a queryset (the delete action's) or a list (the delete page's)."""
    return list(objs.values_list("pk", flat=True)) if isinstance(objs, QuerySet) else [obj.pk for obj in objs]


class CountedDeleteAdmin(LargeListAdmin):
    """A ModelAdmin whose delete page and delete action say what goes with the rows chosen by model
    and count, as Django's page says in its summary, and never read those rows: Django's read each
    one whole to link it (a user's or a job's every call, a session's every file with its bytes, a
    tool's every call to set its tool to null), so the page's load grew with the history, unbounded.
    What it returns is what Django's get_deleted_objects returns, and decides the same: the
    permissions lacking to delete what goes, and the rows a PROTECT relation keeps, each model's
    with what ``protected_because`` says of it (why it is kept, and what to do instead)."""

    protected_because: dict[type[Model], str] = {}
    # What the delete's pages read of each row chosen: what they show of it (its __str__'s fields;
    # a related row's as "relation__field"), and its key, which the action's confirmation posts back.
    # None: the whole row. Read whole, the action's confirmation of 997 calls or jobs read every
    # input and output, or code and stdout, only to post back their keys and name 100 of them.
    delete_shows: tuple[str, ...] | None = None

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        django_s = actions.get("delete_selected")
        if django_s is not None:
            actions["delete_selected"] = (delete_selected_at_once, *django_s[1:])
        return actions

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Django's runs its check and its delete in one transaction: back to its confirmation.
        delete = partial(super().delete_view, request, object_id, extra_context)
        response: HttpResponse = _or_try_again(request, delete, HttpResponseRedirect(request.get_full_path()))
        return response

    def chosen_rows(self, pks: list[Any]) -> QuerySet[Any]:
        """Return the rows of ``pks``, each read as far as the delete's pages show it (delete_shows)."""
        rows = self.model._base_manager.filter(pk__in=pks)
        if self.delete_shows is None:
            return rows
        related = {name.split("__")[0] for name in self.delete_shows if "__" in name}
        return rows.select_related(*related).only(*self.delete_shows)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        ids = pks_of(objs)
        if request.method == "POST":
            # What deletes (the delete page's POST, the action's, each one transaction): checked
            # under the lock, what is counted, the protected rows and what a subclass checks after
            # this (a user's jobs not ended) among them, is what the delete meets.
            deletion_lock(model=self.model, pks=ids)
        deleted, protected = deletion_counts(model=self.model, pks=ids)
        perms_needed = set()
        # Not the protected models' (as Django's): a member may not delete a ledger entry, and the
        # page then said only that, never that the entries are kept nor what to do instead.
        for model in deleted:
            registered = self.admin_site.is_registered(model)
            if registered and not self.admin_site.get_model_admin(model).has_delete_permission(request):
                perms_needed.add(model._meta.verbose_name)
        opts = self.model._meta
        chosen = self.chosen_rows(ids)[:OBJECTS_NAMED]
        named: list[Any] = [f"{opts.verbose_name[:1].upper()}{opts.verbose_name[1:]}: {obj}" for obj in chosen]
        goes = [f"{count:,} {model._meta.verbose_name_plural}" for model, count in deleted.items() if model is not self.model]
        model_count = {model._meta.verbose_name_plural: count for model, count in deleted.items()}
        kept = []
        for model, count in protected.items():
            why = self.protected_because.get(model)
            kept.append(f"{count:,} {model._meta.verbose_name_plural} (protected{f': {why}' if why else ''})")
        return [*named, goes] if goes else named, model_count, perms_needed, kept
