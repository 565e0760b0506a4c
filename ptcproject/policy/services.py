from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction

from ptcproject.policy.models import Policy, PolicyChange
from ptcproject.policy.selectors import POLICY_PK


def policy_ensure() -> Policy:
    """Create the policy row from the PTC_* seed if it does not exist yet (``migrate`` runs this);
    once it exists, the admin and PATCH /api/v1/policy own it. Return it."""
    policy = Policy.objects.filter(pk=POLICY_PK).first()
    if policy is not None:
        return policy
    try:
        with transaction.atomic():
            return Policy.objects.create(pk=POLICY_PK, **settings.PTC_POLICY_SEED)
    except IntegrityError:  # another process created it first
        return Policy.objects.get(pk=POLICY_PK)


@transaction.atomic
def policy_update(*, changed_by: User | None, values: dict[str, Any]) -> Policy:
    """Apply validated ``values`` to the policy and record who changed what, old → new.

    A value equal to the current one is not a change and is not recorded.
    """
    policy_ensure()
    policy = Policy.objects.select_for_update().get(pk=POLICY_PK)
    changes = {}
    for field, new in values.items():
        old = getattr(policy, field)
        if old != new:
            changes[field] = [old, new]
            setattr(policy, field, new)
    if changes:
        policy.save()
        PolicyChange.objects.create(policy=policy, changed_by=changed_by, changes=changes)
    return policy
