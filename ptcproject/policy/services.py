from typing import Any

from django.contrib.auth.models import User
from django.db import transaction

from ptcproject.policy.models import Policy, PolicyChange
from ptcproject.policy.selectors import POLICY_PK, policy_get


@transaction.atomic
def policy_update(*, changed_by: User | None, values: dict[str, Any]) -> Policy:
    """Apply validated ``values`` to the policy and record who changed what, old → new.

    A value equal to the current one is not a change and is not recorded.
    """
    policy_get()
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
