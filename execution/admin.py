import json
import uuid
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet, TextField
from django.db.models.functions import Cast, Left, Length
from django.forms.models import BaseInlineFormSet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from execution.models import ExecJob, ExecSession, ToolCall, WorkFile
from execution.selectors import tool_calls_for
from execution.services.jobs import exec_job_cancel
from execution.services.sessions import exec_session_delete
from execution.services.waiting import tool_call_decide
from execution.timeline import PREVIEW_CHARS, clipped, timeline_build
from ptcproject.accounts.authentication import signed_in_user
from ptcproject.admin_deletes import CountedDeleteAdmin, pks_of
from ptcproject.admin_permissions import has_model_permission
from ptcproject.admin_search import IndexedSearchAdmin
from ptcproject.errors import ApplicationError


def _pre(value: Any) -> str:
    if value is None or value == "":
        return "-"  # the admin's empty value, rather than an empty box or "null"
    text = value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True)
    return format_html('<pre style="white-space:pre-wrap;max-height:30em;overflow:auto">{}</pre>', text)


# The most calls a job's page draws (a managed container's job has no bound on them), and what it
# reads of each: its input and output are read only as far as their previews (timeline.clipped).
DRAWN_MAX = 5000
TIMELINE_FIELDS = (
    *("call_id", "toolset_key", "tool_name", "status", "started_at", "finished_at", "credits", "error"),
    *("decision", "decided_at", "decision_reason", "decided_by__username", "tool__toolset__kind"),
)


# A job's columns that may each hold megabytes: what the code was, printed, returned and wrote.
JOB_BULK = ("code", "stdout", "stderr", "return_value", "error", "client_tools", "output_files", "output_files_omitted")


def _list_without(*fields: str) -> type[ChangeList]:
    """Return a list page that leaves ``fields`` unread: columns it does not show, that may each hold
    megabytes (a job's stdout, a call's output). Read, 100 rows of them were hundreds of MB a page
    load; the change page of one row still reads them all."""

    class Deferred(ChangeList):
        def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
            return super().get_queryset(request, exclude_parameters).defer(*fields)

    return Deferred


def unended_kept(
    deleted: tuple[Any, Any, Any, list[Any]],
    *,
    jobs: QuerySet[ExecJob] | None = None,
    calls: QuerySet[ToolCall] | None = None,
    sessions: QuerySet[ExecSession] | None = None,
) -> tuple[Any, ...]:
    """``deleted`` (what ModelAdmin.get_deleted_objects returns) with the jobs among ``jobs`` that
    have not ended, the open calls among ``calls`` and the active sessions among ``sessions``, named
    as protected, so that the admin deletes nothing and says why: a job not ended is cancelled, not
    deleted (its worker would record its end into nothing); an open call may be running, its
    record what it is charged by when it ends (deleted, it ran for free, and its job's end announced
    it half-written); an active session is ended, not deleted (its queued job ran outside it, in a
    sandbox of its own without its globals or files, and its running one ended SessionEnded rather
    than cancelled, its sandbox left to its worker's next lease round)."""
    to_delete, counts, perms_needed, protected = deleted
    kept = []
    if jobs is not None:
        running = jobs.exclude(status__in=ExecJob.FINISHED).values_list("call_id", "status")
        kept += [f"job {call_id} ({status}: cancel it first)" for call_id, status in running[:20]]
    kept += protected
    if calls is not None:
        open_calls = calls.filter(status__in=ToolCall.OPEN).values_list("call_id", "status")
        kept += [
            f"tool call {call_id} ({status}: it may be running, and is charged when it ends)"
            for call_id, status in open_calls[:20]
        ]
    if sessions is not None:
        active = sessions.filter(status=ExecSession.Status.ACTIVE).values_list("pk", flat=True)
        kept += [f"session {pk} (active: end it first)" for pk in active[:20]]
    return to_delete, counts, perms_needed, kept


@admin.register(ExecJob)
class ExecJobAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("call_id", "user", "status", "title", "created_at", "execution_time_seconds")

    # Not by user: the filter listed every user of the deployment on each load. Search by username.
    list_filter = ("status", "created_at")
    # Matched whole, by their indexes (IndexedSearchAdmin); not the title, which no index serves.
    search_fields = ("id", "call_id", "user__username")
    search_help_text = "A job's id or call id (exec_…), or a username, whole."
    # No date hierarchy: its distinct days were a scan of every job each load (the created-at
    # filter's links stay), and one count a load, not two.
    show_full_result_count = False
    delete_shows = ("call_id",)  # not its code, output or files (CountedDeleteAdmin)
    # The tool calls are drawn as a timeline above these (change_form.html), from one query; a
    # thousand-row inline would be neither readable nor fast.
    fieldsets = (
        ("Code", {"fields": ("code_pre",), "classes": ("ptc-stacked",)}),
        (
            "Result",
            {"fields": ("status", "return_value_pre", "error_pre", "stdout_pre", "stderr_pre"), "classes": ("ptc-stacked",)},
        ),
        ("Job", {"fields": ("id", "call_id", "user", "title", "toolsets", "sdk_hash", "worker", "timeout_seconds", "limits")}),
        (
            "Timings",
            {"fields": ("created_at", "started_at", "finished_at", "execution_time_seconds", "timings_pre", "purged_at")},
        ),
    )
    readonly_fields = tuple(
        name
        for _, options in fieldsets
        for entry in options["fields"]
        for name in ((entry,) if isinstance(entry, str) else entry)  # a tuple entry is fields on one line
    )

    actions = ("cancel_jobs",)

    @admin.action(description="Cancel the selected jobs", permissions=["cancel"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[ExecJob]) -> None:
        """Cancel each job not ended yet, as POST /exec/{id}/cancel does (its sandbox killed, its
        queued calls never run): what the delete page tells an operator to do first, and the only
        end of a managed container's job. One that has ended is left as it ended."""
        for job in queryset.defer(*JOB_BULK):
            try:
                exec_job_cancel(job=job)
            except ApplicationError:  # job_finished: it ended on its own
                self.message_user(request, f"Not cancelled: {job.call_id} had ended ({job.status}).", messages.WARNING)
            else:
                self.message_user(request, f"Cancelled {job.call_id}.", messages.SUCCESS)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        # A job not finished is kept whole, with its calls.
        ids = pks_of(objs)
        jobs, calls = ExecJob.objects.filter(pk__in=ids), ToolCall.objects.filter(exec_job_id__in=ids)
        return unended_kept(super().get_deleted_objects(objs, request), jobs=jobs, calls=calls)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ExecJob]:
        return super().get_queryset(request).select_related("user")

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _list_without(*JOB_BULK)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        # The timeline shows the calls' inputs, outputs and errors: a staff member let view jobs but
        # not tool calls read them there all the same.
        if obj is not None and has_model_permission(request, model=ToolCall, action="view"):
            calls_url = reverse("admin:execution_toolcall_changelist")
            # One query for the calls (and a count past DRAWN_MAX); nothing below touches a related row. Of
            # their inputs and outputs, only as much as a preview shows: read whole, a job's 1,000
            # calls of 64 KB each were 300 MB of Python to draw a page that shows none of it.
            previews = {
                f"{name}_{part}": expression
                for name in ("input", "output")
                for part, expression in (
                    ("head", Left(Cast(name, TextField()), PREVIEW_CHARS + 1)),
                    ("length", Length(Cast(name, TextField()))),
                )
            }
            # At most DRAWN_MAX of them, and of each only what the timeline reads (no tool or toolset
            # row beyond its kind): a managed container's job runs until cancelled, with no bound on
            # its calls, and 20,000 of them whole were 140 MB a load.
            rows = (
                tool_calls_for(user=signed_in_user(request))
                .filter(exec_job=obj)
                .select_related("decided_by", "tool__toolset")
                .only(*TIMELINE_FIELDS)
                .annotate(**previews)
            )
            calls = list(rows[: DRAWN_MAX + 1])
            if len(calls) > DRAWN_MAX:  # one query more, for such a job only
                calls = calls[:DRAWN_MAX]
                context["timeline_total"] = rows.count()
            for call in calls:
                for name in ("input", "output"):
                    setattr(call, name, clipped(getattr(call, f"{name}_head"), getattr(call, f"{name}_length")))
            decide = reverse("admin:execution_execjob_decide", args=[obj.pk])
            context["timeline"] = timeline_build(
                job=obj,
                calls=calls,
                call_url=lambda call: f"{calls_url}{call.pk}/change/",
                decide_url=lambda call: f"{decide}?call_id={call.call_id}",
            )
            context["timeline_calls_url"] = f"{calls_url}?exec_job={obj.pk}"
        return super().render_change_form(request, context, add=add, change=change, form_url=form_url, obj=obj)

    def get_urls(self) -> list[URLPattern]:
        decide = path("<path:object_id>/decide/", self.admin_site.admin_view(self.decide_view), name="execution_execjob_decide")
        return [decide, *super().get_urls()]

    def decide_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST from the timeline: approve or deny one call of this job that waits for an approval."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not has_model_permission(request, model=ToolCall, action="change"):  # the decision is recorded on the call
            raise PermissionDenied
        user = signed_in_user(request)
        back = reverse("admin:execution_execjob_change", args=[object_id])
        try:
            job_id = uuid.UUID(object_id)
        except ValueError:
            raise Http404("No such job.") from None
        call = tool_calls_for(user=user).filter(exec_job_id=job_id, call_id=request.GET.get("call_id", "")).first()
        if call is None:
            raise Http404("No such call in this job.")
        approve = request.POST.get("approve") == "1"
        try:
            tool_call_decide(call=call, actor=user, approve=approve, reason=request.POST.get("reason", "")[:500])
        except ApplicationError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(
                request, f"{call.toolset_key}.{call.tool_name} ({call.call_id}) {'approved' if approve else 'denied'}."
            )
        return HttpResponseRedirect(back)

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        # A job has no form to change, but its model's change permission is what cancelling it asks.
        return has_model_permission(request, model=ExecJob, action="change")

    @admin.display(description="code")
    def code_pre(self, job: ExecJob) -> str:
        lines = format_html_join("", "<span>{}</span>", ((line,) for line in job.code.splitlines()))
        return format_html('<div class="ptc-code">{}</div>', lines)

    @admin.display(description="stdout")
    def stdout_pre(self, job: ExecJob) -> str:
        return _pre(job.stdout)

    @admin.display(description="stderr")
    def stderr_pre(self, job: ExecJob) -> str:
        return _pre(job.stderr)

    @admin.display(description="return value")
    def return_value_pre(self, job: ExecJob) -> str:
        return _pre(job.return_value)

    @admin.display(description="error")
    def error_pre(self, job: ExecJob) -> str:
        return _pre(job.error)

    @admin.display(description="timings")
    def timings_pre(self, job: ExecJob) -> str:
        return _pre(job.timings)


@admin.register(ToolCall)
class ToolCallAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("call_id", "type", "toolset_key", "tool_name", "status", "decision", "user", "credits", "started_at")
    # Not by toolset key: the filter was every distinct key in the table (users name their own
    # toolsets freely), a scan of every call each load. Search finds a toolset's calls. Not by type:
    # no index serves it, and a page of the rarer type (ptc or standalone, by the deployment) was
    # found only by reading every call newer than its page; an index of every call's type would be
    # written on every call. A job's calls are found by its call id (search). A decision is rare
    # (a tool that needs approval) and its index holds only the calls decided (toolcall_decided).
    list_filter = ("status", "decision", "started_at")
    # Matched whole, by their indexes (IndexedSearchAdmin): the job's call id (ptc_call_id) by the
    # job, and a toolset's calls by its tools (those of a tool since deleted by their job or user).
    search_fields = ("call_id", "exec_job__call_id", "user__username", "tool__toolset__key", "tool__name")
    search_help_text = (
        "A call id (ptc_…, standalone_…), its job's call id (exec_…), a username, a toolset's key or a tool's name, whole."
    )
    # The largest table of all (a row a call), and started_at has no index of its own (each index
    # is written twice a call): ordered by it (the model's oldest-first ordering) and drawn with a
    # date hierarchy (its min, max and distinct days), each load of the list read every row, 1 s
    # at 400,000 calls and growing with them. Newest first by id reads a page of the primary key;
    # the started-at filter's links (today, past 7 days...) stay. One count, not two.
    ordering = ("-id",)
    show_full_result_count = False
    delete_shows = ("call_id",)  # not its input, output or error (CountedDeleteAdmin)
    readonly_fields = [f.name for f in ToolCall._meta.fields]

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _list_without("input", "output", "error")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        # Every field is shown read-only, yet a Save wrote the whole row back as the request had read
        # it: a worker's finish committed meanwhile was undone (the call executing again, its credits
        # 0, the ledger having charged it). Its workers and services write it; a decision is made on
        # its job's timeline.
        return False

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        calls = ToolCall.objects.filter(pk__in=pks_of(objs))
        return unended_kept(super().get_deleted_objects(objs, request), calls=calls)


# The most files a session's page lists: a session may hold any number (its code writes them), and
# its page drew each as a row, read with its bytes. The rest are in the file list, by the link.
FILES_SHOWN = 100


class _FirstFiles(BaseInlineFormSet):
    def get_queryset(self) -> QuerySet[WorkFile]:
        # The first FILES_SHOWN by path: the session's (session, path) index reads them and no more.
        return super().get_queryset()[:FILES_SHOWN]


class WorkFileInline(admin.TabularInline):
    model = WorkFile
    formset = _FirstFiles
    fields = ("path", "kind", "size", "pending", "updated_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True
    verbose_name_plural = f"files (the first {FILES_SHOWN} by path; all of them by the link above)"

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkFile]:
        return super().get_queryset(request).defer("content")  # bytes, shown by size

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(ExecSession)
class ExecSessionAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("id", "user", "status", "worker", "jobs_run", "created_at", "last_used_at", "expires_at")
    list_filter = ("status", "created_at")  # not by user: as for jobs
    search_fields = ("id", "user__username")  # matched whole, by their indexes (IndexedSearchAdmin)
    search_help_text = "A session's id or a username, whole."
    date_hierarchy = "created_at"
    delete_shows = ("id",)
    readonly_fields = [*(f.name for f in ExecSession._meta.fields), "all_files"]
    inlines = [WorkFileInline]
    actions = ("end_sessions",)

    @admin.display(description="files")
    def all_files(self, session: ExecSession) -> str:
        """A link to the session's files in the file list: its page lists the first FILES_SHOWN."""
        url = reverse("admin:execution_workfile_changelist")
        return format_html('<a href="{}?session__id__exact={}">All of its files</a>', url, session.pk)

    @admin.action(description="End the selected sessions", permissions=["end"])
    def end_sessions(self, request: HttpRequest, queryset: QuerySet[ExecSession]) -> None:
        """End each active session, as DELETE /sessions/{id} does (its running job cancelled, its
        queued one failed, its sandbox killed, its files deleted): what the delete page tells an
        operator to do first. One that has ended is left as it ended, its files with it."""
        for session in queryset:
            if session.status != ExecSession.Status.ACTIVE:
                self.message_user(request, f"Not ended: {session.pk} had ended ({session.status}).", messages.WARNING)
                continue
            ended = exec_session_delete(session=session, ended_too=False)
            if ended.status == ExecSession.Status.DELETED:
                self.message_user(request, f"Ended {session.pk}.", messages.SUCCESS)
            else:  # it ended on its own meanwhile (expired, lost)
                self.message_user(request, f"Not ended: {session.pk} had ended ({ended.status}).", messages.WARNING)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, ...]:
        sessions = ExecSession.objects.filter(pk__in=pks_of(objs))
        return unended_kept(super().get_deleted_objects(objs, request), sessions=sessions)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ExecSession]:
        return super().get_queryset(request).select_related("user")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_end_permission(self, request: HttpRequest) -> bool:
        # As for a job's cancel: the session's change permission, though it has no form to change.
        return has_model_permission(request, model=ExecSession, action="change")


@admin.register(WorkFile)
class WorkFileAdmin(IndexedSearchAdmin, CountedDeleteAdmin):
    list_display = ("path", "kind", "size", "pending", "session", "exec_job", "updated_at")
    list_filter = ("kind", "pending", "updated_at")
    search_fields = ("session", "exec_job__call_id")  # matched whole, by their indexes (IndexedSearchAdmin)
    search_help_text = "A session's id or a job's call id (exec_…), whole."
    # Newest first, by the primary key: the model's order, by path, has no index of its own (a
    # file's are per session and per job), and sorted every file of the deployment each load.
    ordering = ("-id",)
    # The contents are bytes: shown by size, downloaded through the API.
    readonly_fields = ("session", "exec_job", "kind", "path", "size", "pending", "updated_at")
    exclude = ("content",)
    delete_shows = ("path",)  # not its bytes (CountedDeleteAdmin)

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkFile]:
        # Of its job, not the bulk: joined whole, 100 files' jobs were 200 MB of their output a load.
        job_bulk = [f"exec_job__{name}" for name in JOB_BULK]
        return super().get_queryset(request).defer("content", *job_bulk).select_related("session", "exec_job")

    def has_add_permission(self, request: Any) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False
