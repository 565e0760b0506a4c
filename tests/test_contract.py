"""The contract, checked by a tool: schemathesis reads the OpenAPI document that /api/schema/ serves,
generates requests for every operation, valid ones and invalid ones, sends them to the running stack
(uvicorn, Celery workers, PostgreSQL, Redis) with a user's key and with a staff key, and checks
each answer: never a 5xx, a status and a content type the document lists, and a body that matches
the document's schema for that status (API.md: every 4xx has the ApiError body).

The examples are bounded and derandomized, so the run is the same each time and takes about a
minute on two cores. What would harm the shared test database, or hold a request for long, is
narrowed or left out below, each with its reason.
"""

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from django.forms.models import model_to_dict
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from execution.models import ExecJob
from ptcproject.policy.models import Policy
from ptcproject.policy.selectors import policy_get
from tests.conftest import Api
from tests.stack import Stack
from tools.models import Toolset

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Fuzzing examples per operation, on top of the schema's own examples and the coverage phase's
# boundary values. PTC_CONTRACT_EXAMPLES=N is a longer hunt, with new random examples each run.
HUNT = os.environ.get("PTC_CONTRACT_EXAMPLES")
MAX_EXAMPLES = int(HUNT or 25)
# A job posted by the contract test runs at most this long, and its request does not wait for it.
JOB_TIMEOUT = 2

CONFIG = {
    "request-timeout": 30,
    "generation": {
        "mode": "all",  # valid input and invalid input (wrong types, out of bounds, missing fields)
        "max-examples": MAX_EXAMPLES,
        "deterministic": not HUNT,  # the same examples on every run: a failure here is never a fluke
        "database": "none",
        # The key is sent by the test; a generated Authorization header would only be a bad key.
        "with-security-parameters": False,
    },
    # Values seen in answers are not fed back into requests: they would aim writes at real objects
    # (the demo toolset, other tests' jobs) and at tools that block (demo.sleep).
    "phases": {
        "examples": {"extra-data-sources": {"responses": False}},
        "coverage": {"extra-data-sources": {"responses": False}},
        "fuzzing": {"extra-data-sources": {"responses": False}},
    },
}


def _document() -> dict[str, Any]:
    """The OpenAPI document /api/schema/ serves, made by the same generator. Made here because
    schemathesis's pytest plugin needs it when the module is collected, before the stack runs; the
    requests still all go to the running stack."""
    document = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(document))


schema = schemathesis.openapi.from_dict(_document(), config=schemathesis.Config.from_dict(CONFIG))


def test_the_document_checked_is_the_one_served(stack: Stack) -> None:
    served = httpx.get(f"{stack.base_url}/api/schema/", headers={"Accept": "application/json"})
    assert served.json() == _document()


# Staff writes that would change or remove toolsets other tests rely on (``demo``), or start an MCP
# server: left out for staff. As a user, each is a 403 and is checked.
STAFF_EXCLUDED = {
    ("PUT", "/api/v1/toolsets/{key}"),
    ("PATCH", "/api/v1/toolsets/{key}"),
    ("DELETE", "/api/v1/toolsets/{key}"),
    ("POST", "/api/v1/toolsets/{key}/sync"),
}


def _staff_excluded(ctx: Any) -> bool:
    return (ctx.operation.method.upper(), ctx.operation.path) in STAFF_EXCLUDED


staff_schema = schema.exclude(_staff_excluded)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _narrow(case: Any) -> None:
    """POST /api/v1/exec runs real jobs: a valid ``wait`` becomes 0 (the request would hold for up to
    a minute) and a valid ``timeout`` at most JOB_TIMEOUT (the job would hold a worker). Invalid ones
    are sent as generated."""
    if (case.operation.method.upper(), case.operation.path) != ("POST", "/api/v1/exec") or not isinstance(case.body, dict):
        return
    if _is_number(case.body.get("wait")) and 0 < case.body["wait"] <= 60:
        case.body["wait"] = 0
    if _is_number(case.body.get("timeout")) and JOB_TIMEOUT < case.body["timeout"] <= 3600:
        case.body["timeout"] = JOB_TIMEOUT


def _call(case: Any, api: Api, examples: Counter[str]) -> None:
    _narrow(case)
    examples[case.operation.label] += 1
    case.call_and_validate(
        base_url=str(api.http.base_url).rstrip("/"), headers={"Authorization": f"Bearer {api.key}"}, checks=CHECKS
    )


def _jobs_end(api: Api) -> None:
    """Wait until the jobs ``api`` posted have ended (within JOB_TIMEOUT each), so they don't load the
    tests that follow. A managed container's job (POST /tools/execute with a container_id) runs no
    code and stays running by design: it loads nothing."""
    deadline = time.monotonic() + 120
    while ExecJob.objects.filter(user__username=api.username, finished_at__isnull=True, container_id="").exists():
        assert time.monotonic() < deadline, "jobs posted by the contract test did not end"
        time.sleep(0.5)


@pytest.fixture
def user_api(make_api: Callable[..., Api]) -> Iterator[Api]:
    api = make_api()
    yield api
    _jobs_end(api)


@pytest.fixture
def staff_api(make_api: Callable[..., Api]) -> Iterator[Api]:
    """A staff user; the policy and the toolsets are put back as they were after the run."""
    policy = model_to_dict(policy_get(), exclude=["id"])
    toolsets = set(Toolset.objects.values_list("pk", flat=True))
    api = make_api(staff=True)
    yield api
    _jobs_end(api)
    Policy.objects.filter(pk=policy_get().pk).update(**policy)
    Toolset.objects.exclude(pk__in=toolsets).delete()


@pytest.fixture
def examples() -> Iterator[Counter[str]]:
    """Counts the requests sent for the operation. None fails the test: a contract test that checked
    nothing must not pass."""
    ran: Counter[str] = Counter()
    yield ran
    assert ran.total() > 0, "schemathesis sent no request for this operation: its contract was not checked"


# A live stack is slower than Hypothesis expects; and the key and the counter are meant to be shared
# by all of an operation's examples (function-scoped fixtures: one set per operation).
HEALTH = settings(
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ]
)


@schema.parametrize()
@HEALTH
def test_contract_as_a_user(case: Any, user_api: Api, examples: Counter[str]) -> None:
    _call(case, user_api, examples)


@staff_schema.parametrize()
@HEALTH
def test_contract_as_staff(case: Any, staff_api: Api, examples: Counter[str]) -> None:
    _call(case, staff_api, examples)
