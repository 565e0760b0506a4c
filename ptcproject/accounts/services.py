import functools
import hashlib
import hmac
import logging
import secrets
from contextlib import nullcontext
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models import SET_NULL
from django.utils import timezone

from billing.models import CreditUsage
from execution.models import ExecJob, ToolCall
from ptcproject import rows
from ptcproject.accounts.models import ApiKey, ApiKeyEvent
from ptcproject.deletion import delete_in_batches, update_in_batches
from ptcproject.errors import ApplicationError
from tools.models import Tool
from tools.services import tool_calls_unlink

logger = logging.getLogger("ptc.accounts")
KEY_PREFIX = "ptc_"
# Writing last_used_at on every request would turn each read into a write; once a minute is enough.
LAST_USED_RESOLUTION = timedelta(seconds=60)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _audit(*, key: ApiKey, actor: User | None, action: str, source: str, details: dict[str, Any] | None = None) -> None:
    """Record a change to a user's key (who, when, what) as a row and a log line; never the secret."""
    details = {"source": source, **(details or {})}
    ApiKeyEvent.objects.create(key=key, actor=actor, action=action, details=details)
    actor_id = actor.pk if actor else None
    extra = {"key_id": str(key.pk), "prefix": key.prefix, "owner_id": key.user_id, "actor_id": actor_id, "details": details}
    # Said once it is so: a change rolled back with its transaction (a later step of the same
    # command failed) logs nothing.
    transaction.on_commit(lambda: logger.info("api key %s", action, extra=extra))


def _within_acting_key(*, acting_key: ApiKey | None, expires_at: datetime | None) -> None:
    """Raise ApplicationError ``permission_denied`` (403) if a request made with ``acting_key``, a
    key that expires, would have a key work past that: never expire, or expire later.

    Otherwise a key handed out for an hour, once leaked, could mint a key that never expires (or
    lift its own expiry), and outlive itself. A key with no expiry, the admin and the CLI are not bound.
    """
    if acting_key is None or acting_key.expires_at is None:
        return
    if expires_at is not None and expires_at <= acting_key.expires_at:
        return
    asked = "no expiry" if expires_at is None else f"an expiry of {expires_at.isoformat()}"
    raise ApplicationError(
        "permission_denied",
        f"The key this request was made with expires at {acting_key.expires_at.isoformat()}; it can't give a key "
        f"{asked}, which would outlive it. Ask for an expiry no later than that, or use a key without an expiry.",
        status=403,
        details={"expires_at": [f"must be no later than {acting_key.expires_at.isoformat()}"]},
    )


def api_key_create(
    *,
    user: User,
    name: str = "",
    expires_at: datetime | None = None,
    exec_job: Any = None,
    actor: User | None = None,
    source: str = "system",
    acting_key: ApiKey | None = None,
    bounded: bool = False,
) -> tuple[ApiKey, str]:
    """Create a key for ``user`` (job-scoped if ``exec_job`` is given).

    Return the row and the plaintext key, which is never stored. A user's own key is audited; a
    job-scoped one is not (one per job, revoked with it, and never listed). ``acting_key`` is the
    key the request was made with: a key that expires may not make one that outlives it
    (``permission_denied``, 403). A ``bounded`` one (the user's own request) is refused with
    ``too_many_keys`` (409) when the user has PTC_MAX_KEYS_PER_USER keys that work.
    """
    _within_acting_key(acting_key=acting_key, expires_at=expires_at)
    prefix = secrets.token_hex(6)
    plaintext = f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    # A job's key is one INSERT, with nothing to audit: no BEGIN and COMMIT around it (every job makes one).
    with transaction.atomic() if exec_job is None else nullcontext():
        if bounded:
            _keys_within_limit(user=user)
        key = ApiKey.objects.create(
            user=user, name=name, prefix=prefix, key_hash=_hash(plaintext), expires_at=expires_at, exec_job=exec_job
        )
        if exec_job is None:
            details = {"name": name, "expires_at": expires_at.isoformat() if expires_at else None}
            _audit(key=key, actor=actor, action=ApiKeyEvent.Action.CREATED, source=source, details=details)
    return key, plaintext


def _keys_within_limit(*, user: User, then: str = "make this one") -> None:
    """Raise ApplicationError ``too_many_keys`` (409) if ``user`` has PTC_MAX_KEYS_PER_USER keys of
    their own that work. Locks the user's row till the transaction ends: two requests at once are
    counted one after the other."""
    _user_locked(user_id=user.pk)
    now = timezone.now()
    working = ApiKey.objects.filter(user=user, exec_job__isnull=True, revoked_at__isnull=True)
    count = working.exclude(expires_at__lte=now).count()
    limit = settings.PTC_MAX_KEYS_PER_USER
    if count >= limit:
        raise ApplicationError(
            "too_many_keys",
            f"You have {count} keys that work; the limit is {limit}. Revoke one you no longer use "
            f"(POST /api/v1/keys/{{id}}/revoke) or let one expire, then {then}.",
            status=409,
            details={"active": count, "limit": limit},
        )


def _user_locked(*, user_id: Any) -> None:
    """Lock the user's row till the transaction ends (again: no wait)."""
    list(get_user_model().objects.select_for_update().filter(pk=user_id).values_list("pk"))


def job_keys_revoke(*, exec_job_id: Any) -> bool:
    """Revoke every key scoped to the job (it has ended); one revoked already keeps its time.
    Return True if any of them was ever used: a key's first use is recorded (``last_used_at``)."""
    sql = (
        f"UPDATE {rows.table(ApiKey)} SET revoked_at = COALESCE(revoked_at, %s) "  # noqa: S608 - names from the model
        "WHERE exec_job_id = %s RETURNING last_used_at"
    )
    with connection.cursor() as cursor:
        job = ApiKey._meta.get_field("exec_job").get_db_prep_value(exec_job_id, connection)  # SQLite keeps UUIDs as hex
        cursor.execute(sql, [timezone.now(), job])
        return any(used is not None for (used,) in cursor.fetchall())


def api_key_revoke(*, key: ApiKey, actor: User | None = None, source: str = "system") -> ApiKey:
    """Revoke ``key`` if it is not already (revoking twice changes nothing and records nothing).

    Return the key as stored afterwards.
    """
    with transaction.atomic():
        changed = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        key.refresh_from_db()
        if changed and key.exec_job_id is None:
            _audit(key=key, actor=actor, action=ApiKeyEvent.Action.REVOKED, source=source)
    return key


def api_key_expire(
    *,
    key: ApiKey,
    expires_at: datetime | None,
    actor: User | None = None,
    source: str = "system",
    acting_key: ApiKey | None = None,
    bounded: bool = False,
) -> ApiKey:
    """Set when ``key`` stops working (a time in the past ends it now; None: never). Return the key as stored.

    A revoked key stays revoked: changing its expiry is refused with ``conflict``, so nobody reads
    a new expiry as the key being usable again. ``acting_key`` is the key the request was made
    with: a key that expires may not have any key (itself among them) work past its own end
    (``permission_denied``, 403). A ``bounded`` one (the user's own request) that would make an
    expired key work again is a key made: refused with ``too_many_keys`` (409) as ``api_key_create``
    refuses one, the expired key not being among those that work.
    """
    _within_acting_key(acting_key=acting_key, expires_at=expires_at)
    now = timezone.now()
    with transaction.atomic():
        if bounded:  # the user's row before the key's, as a key made locks it: one count at a time
            _user_locked(user_id=key.user_id)
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        if locked.revoked_at is not None:
            raise ApplicationError(
                "conflict", "This key is revoked; a revoked key can't be given a new expiry. Create a new key."
            )
        expired = locked.expires_at is not None and locked.expires_at <= now
        if bounded and expired and (expires_at is None or expires_at > now) and locked.exec_job_id is None:
            _keys_within_limit(user=locked.user, then="give this expired key its new expiry")
        old = locked.expires_at
        locked.expires_at = expires_at
        locked.save(update_fields=["expires_at"])
        if locked.exec_job_id is None:
            change = [old.isoformat() if old else None, expires_at.isoformat() if expires_at else None]
            _audit(key=locked, actor=actor, action=ApiKeyEvent.Action.EXPIRY_SET, source=source, details={"expires_at": change})
    return locked


@functools.cache
def _key_sql() -> str:
    users = get_user_model()
    return (
        f"SELECT {rows.columns(ApiKey, 'k')}, {rows.columns(users, 'u')} FROM {rows.table(ApiKey)} k "  # noqa: S608 - names from the models
        f"JOIN {rows.table(users)} u ON u.id = k.user_id WHERE k.prefix = %s"
    )


def _key_with_user(*, prefix: str) -> ApiKey | None:
    """Return the key with this prefix (unique), its user loaded, or None. Every request makes this
    read: a fixed statement (ptcproject/rows.py) rather than a queryset compiled each time."""
    with connection.cursor() as cursor:
        cursor.execute(_key_sql(), [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    key = rows.from_row(ApiKey, row)
    key.user = rows.from_row(get_user_model(), row, start=len(ApiKey._meta.concrete_fields))
    return key


def _key_prefix(plaintext: str) -> str | None:
    """The prefix a key's row is found by (``ptc_<prefix>_<secret>``), or None for no key of ours."""
    return plaintext[len(KEY_PREFIX) :].split("_", 1)[0] if plaintext.startswith(KEY_PREFIX) else None


def _is_key(key: ApiKey, plaintext: str) -> bool:
    return hmac.compare_digest(key.key_hash, _hash(plaintext))


def api_key_authenticate(*, plaintext: str) -> ApiKey | None:
    """Return the active key row for ``plaintext``, or None if it is unknown, expired or revoked."""
    prefix = _key_prefix(plaintext)
    key = _key_with_user(prefix=prefix) if prefix is not None else None
    if key is None or not _is_key(key, plaintext):
        return None
    if not key.is_active or not key.user.is_active:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def still_signed_in(*, user_id: Any, key_id: Any = None) -> bool:
    """Whether a caller let in earlier, as ``user_id`` with its key ``key_id`` (None: without one,
    an admin session or stdio's fixed user), would still be: its key not revoked or expired since,
    its user not deactivated. For what was let in once and goes on (a job's event stream, a job an
    MCP call follows). A database out of reach says yes: an outage is no reason to cut them."""
    try:
        if key_id is None:
            return get_user_model().objects.filter(pk=user_id, is_active=True).exists()
        key = ApiKey.objects.select_related("user").filter(pk=key_id, user_id=user_id).first()
        return key is not None and key.is_active and key.user.is_active
    except DatabaseError:
        return True


def job_key_ended(*, plaintext: str) -> ApplicationError | None:
    """For a job-scoped key that no longer works because its job ended, the 409 ``job_ended`` to
    answer (its holder, a sandbox elsewhere, learns the job is over rather than that its key is
    wrong); None for any other key that does not authenticate. Read only on that failure path."""
    prefix = _key_prefix(plaintext)
    key = (
        ApiKey.objects.filter(prefix=prefix, exec_job__isnull=False).select_related("exec_job").first()
        if prefix is not None
        else None
    )
    if key is None or not _is_key(key, plaintext) or key.exec_job is None:
        return None
    job = key.exec_job
    if job.status not in job.FINISHED:  # revoked while it runs (an admin's doing): not its end
        return None
    message = f"Job {job.call_id} has ended (it is {job.status}); its key no longer works and no call can start."
    return ApplicationError("job_ended", message, status=409)


def _field_check(model: Any, field: str, value: str, shown: str) -> None:
    """Raise ApplicationError ``validation_error`` naming ``shown`` if ``value`` is not one the
    model's ``field`` takes (empty where it must not be, too long, characters its validators refuse)."""
    try:
        model._meta.get_field(field).clean(value, None)
    except ValidationError as exc:
        quoted = repr(value if len(value) <= 60 else f"{value[:60]}…")
        raise ApplicationError("validation_error", f"{shown} {quoted} can't be used: {' '.join(exc.messages)}") from None


@transaction.atomic
def user_with_key_create(*, username: str, create_user: bool, staff: bool, name: str = "", credits: int = 0) -> tuple[User, str]:
    """Find (or with ``create_user``, create) ``username`` and give it a new key.

    Raises ``LookupError`` when the user does not exist and ``create_user`` is false.
    """
    users = get_user_model()
    _field_check(ApiKey, "name", name, "--name")
    user = users.objects.filter(username=username).first()
    if user is None:
        if not create_user:
            raise LookupError(f"User '{username}' does not exist; pass --create-user to create it.")
        _field_check(users, "username", username, "the username")
        try:
            with transaction.atomic():
                user = users.objects.create_user(username=username)
        except IntegrityError:  # the same command, run at once, created it first: it gets a key too
            user = users.objects.get(username=username)
    if staff and not user.is_staff:
        user.is_staff = True
        user.save(update_fields=["is_staff"])
    _, plaintext = api_key_create(user=user, name=name, source="cli")
    if credits:
        from billing.services import credits_adjust

        credits_adjust(user=user, amount=credits, reason="granted with a new API key (create_api_key --credits)")
    return user, plaintext


def users_history_delete(*, user_ids: list[Any]) -> None:
    """Delete the finished history of the users ``user_ids`` a batch a statement (delete_in_batches),
    for a delete of the users to follow: their finished tool calls and their credit usage rows,
    the finished calls of others made with their own toolsets unlinked from them (tool_calls_unlink),
    then their finished jobs (each batch with its keys, files and what is left of its calls); and
    the rows that name them and are kept (a call they decided, an entry they granted, a key event
    or a policy change they made: each relation to a user that sets null), unlinked.

    Django's delete of a user did each in one statement, or read every row's id first (their jobs,
    to delete what links to them IN that list): a user of a few million calls ran past
    PTC_DB_STATEMENT_TIMEOUT, and the delete failed, every time. What has not ended (a job, a call)
    is left to the delete itself; the admin deletes no user who has any (unended_kept)."""
    delete_in_batches(ToolCall.objects.filter(user_id__in=user_ids).exclude(status__in=ToolCall.OPEN))
    delete_in_batches(CreditUsage.objects.filter(user_id__in=user_ids))
    tool_calls_unlink(tools=Tool.objects.filter(toolset__owner_id__in=user_ids))
    # A job takes its key, the key's events and its files with it: fewer a statement.
    delete_in_batches(ExecJob.objects.filter(user_id__in=user_ids, status__in=ExecJob.FINISHED), size=100)
    for relation in get_user_model()._meta.related_objects:
        if relation.on_delete is SET_NULL:  # an approver's millions of decisions were one UPDATE too
            name = relation.field.name
            unlinked: dict[str, Any] = {name: None}
            update_in_batches(relation.related_model._base_manager.filter(**{f"{name}__in": user_ids}), **unlinked)
