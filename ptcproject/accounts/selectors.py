from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db.models import Q, QuerySet

from ptcproject.accounts.models import ApiKey


def api_keys_listed(*, user: User) -> QuerySet[ApiKey]:
    """The user's own keys, newest first: job-scoped keys are the system's, not the user's."""
    return ApiKey.objects.filter(user=user, exec_job__isnull=True)


def api_key_listed(*, user: User, key_id: Any) -> ApiKey | None:
    """Return the user's own key ``key_id``, or None (another user's key, or a job's, is not theirs)."""
    return api_keys_listed(user=user).filter(pk=key_id).first()


def api_key_owners(*, actor: User) -> QuerySet[User]:
    """The users ``actor`` may make keys for, and whose keys they may change or revoke, in the admin:
    every user for a superuser; for anyone else, themselves and the users who are neither staff nor
    superusers. A key acts as its owner, and a staff owner's key may do all over the API: a staff
    member let only add keys made one for a superuser, and was one."""
    users = get_user_model().objects.all()
    return users if actor.is_superuser else users.filter(Q(pk=actor.pk) | Q(is_staff=False, is_superuser=False))


def api_key_owner_allowed(*, actor: User, owner: User) -> bool:
    """Return True if ``owner`` is among ``api_key_owners(actor=actor)``, read from the rows at hand."""
    return actor.is_superuser or owner.pk == actor.pk or not (owner.is_staff or owner.is_superuser)
