import re

import httpx

from tests.conftest import METRICS_TOKEN
from tests.stack import Stack


def test_healthz_and_readyz(stack: Stack) -> None:
    assert httpx.get(f"{stack.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.base_url}/readyz")
    assert ready.status_code == 200, ready.text


def test_probes_and_metrics_answer_a_pod_ip_as_host(stack: Stack) -> None:
    """The kubelet probes a pod at its IP, and Prometheus scrapes it so; DJANGO_ALLOWED_HOSTS names
    the public host (deploy/kubernetes). They were 400, and the liveness probe restarted every web pod."""
    pod = {"Host": "10.1.2.3:8000"}
    assert httpx.get(f"{stack.base_url}/healthz", headers=pod).status_code == 200
    assert httpx.get(f"{stack.base_url}/readyz", headers=pod).status_code == 200
    metrics = httpx.get(f"{stack.base_url}/metrics", headers={**pod, "Authorization": f"Bearer {METRICS_TOKEN}"})
    assert metrics.status_code == 200 and "ptc_fleet_up" in metrics.text
    assert httpx.get(f"{stack.base_url}/metrics", headers=pod).status_code == 401  # still the token's
    # Every other path keeps Django's check of the Host.
    assert httpx.get(f"{stack.base_url}/api/v1/exec", headers=pod).status_code == 400


def test_openapi_schema_and_docs_are_served_offline(stack: Stack) -> None:
    schema = httpx.get(f"{stack.base_url}/api/schema/", headers={"Accept": "application/json"})
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in ("/api/v1/exec", "/api/v1/exec/{job_id}", "/api/v1/exec/{job_id}/cancel", "/api/v1/tool-calls"):
        assert path in paths
    docs = httpx.get(f"{stack.base_url}/api/docs/")
    assert docs.status_code == 200
    # Every asset it loads is this server's, and no URL in it names a CDN. (Not a bare "cdn" in the
    # text: the page carries a random token, which now and then spells it.)
    assets = re.findall(r'(?:src|href)="([^"]*)"', docs.text)
    assert assets and all(asset.startswith("/") for asset in assets), assets
    assert not re.search(r"https?://[^\s\"']*cdn", docs.text, re.IGNORECASE)
    for asset in assets:
        assert httpx.get(f"{stack.base_url}{asset}").status_code == 200, asset


def test_every_operation_documents_its_errors_with_the_error_body(stack: Stack) -> None:
    schema = httpx.get(f"{stack.base_url}/api/schema/", headers={"Accept": "application/json"}).json()
    error = {"$ref": "#/components/schemas/ApiError"}
    assert schema["components"]["schemas"]["ApiError"]["required"] == ["error"]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert {"401", "503"} <= set(responses), (method, path)
            if "{" in path:
                assert "404" in responses, (method, path)
            if "requestBody" in operation:
                assert {"400", "413"} <= set(responses), (method, path)
            for status, response in responses.items():
                if status[0] in "45":
                    assert response["content"]["application/json"]["schema"] == error, (method, path, status)


def test_the_tool_call_endpoint_documents_its_worker_unavailable() -> None:
    # A job-scoped key's call asks the job's bridge whether it may start: a worker that never
    # answers is 503 worker_unavailable, to retry. The document said only database_unavailable or
    # broker_unavailable there, and a client built from it could not know it.
    from drf_spectacular.generators import SchemaGenerator

    document = SchemaGenerator().get_schema(request=None, public=True)
    unavailable = document["paths"]["/api/v1/tools/execute"]["post"]["responses"]["503"]
    assert "worker_unavailable" in unavailable["description"]
    assert {"database_unavailable", "broker_unavailable"} <= set(unavailable["description"].replace(":", " ").split())
    assert "Retry-After" in unavailable["headers"]
