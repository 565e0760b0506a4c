"""What a staff member may do in the admin beyond its forms: its actions and pages of its own.

An action without ``permissions`` is offered to whoever may see the list (a view permission), and a
page of ``admin_view`` only asks that its reader be staff: a staff member let only view credit
accounts granted credits with the list's action, one let view jobs cancelled them, and any staff
member read every user's spend on the usage chart.
"""

from django.contrib.auth import get_permission_codename
from django.db.models import Model
from django.http import HttpRequest


def has_model_permission(request: HttpRequest, *, model: type[Model], action: str) -> bool:
    """Return True if the signed-in user holds ``model``'s ``action`` permission (``change``, ``view``...)."""
    opts = model._meta
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename(action, opts)}")
