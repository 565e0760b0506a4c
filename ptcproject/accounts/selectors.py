from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet

from ptcproject.accounts.models import ApiKey


def api_keys_listed(*, user: User) -> QuerySet[ApiKey]:
    """The user's own keys, newest first: job-scoped keys are the system's, not the user's."""
    return ApiKey.objects.filter(user=user, exec_job__isnull=True)


def api_key_listed(*, user: User, key_id: Any) -> ApiKey | None:
    """Return the user's own key ``key_id``, or None (another user's key, or a job's, is not theirs)."""
    return api_keys_listed(user=user).filter(pk=key_id).first()
