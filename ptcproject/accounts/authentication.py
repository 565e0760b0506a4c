from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from ptcproject.accounts.models import ApiKey
from ptcproject.accounts.services import api_key_authenticate, job_key_ended

# What a request with a key that won't do is told, here and at the SSE endpoint alike.
KEY_REFUSED = "The API key is unknown, expired or revoked."
JOB_KEY_ELSEWHERE = "A job-scoped key can only call POST /api/v1/tools/execute."


def signed_in_user(request: HttpRequest | Request) -> User:
    """Return the user a request was authenticated as, in a view no anonymous request reaches.

    Every API view requires IsAuthenticated (the default) or IsAdminUser, and every admin view a staff
    login, so ``request.user`` is never an AnonymousUser there; the assert says so to mypy, and fails
    loudly should a view ever lose its permission class.
    """
    user = request.user
    assert isinstance(user, User), f"{request.path} reached a signed-in-only view without a signed-in user"
    return user


def request_key(request: Request) -> ApiKey | None:
    """The API key a request was made with (None for an admin session)."""
    return request.auth if isinstance(request.auth, ApiKey) else None


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer <api key>``."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, Any] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        token = token.strip()
        if not token:
            raise exceptions.AuthenticationFailed("The Authorization header has no key after 'Bearer'.")
        key = api_key_authenticate(plaintext=token)
        view = (request.parser_context or {}).get("view")
        if key is None:
            ended = job_key_ended(plaintext=token) if getattr(view, "allow_job_keys", False) else None
            if ended is not None:
                raise ended
            raise exceptions.AuthenticationFailed(KEY_REFUSED)
        if key.exec_job_id is not None and not getattr(view, "allow_job_keys", False):
            raise exceptions.PermissionDenied(JOB_KEY_ELSEWHERE)
        return key.user, key

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "A PTC API key: `ptc_<prefix>_<secret>`."}
