"""deploy/: the compose file and the Kubernetes examples run the fleet this code expects: every
process, one worker command per queue, and a KEDA ScaledObject on each queue's real Redis list."""

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from django.conf import settings

from ptcproject import queues
from tests.stack import ROOT

DEPLOY = ROOT / "deploy"
# The longest a job may run with the policy's defaults: its timeout, and the waits on its client
# (client tools, approvals) that its clock does not count. A warm shutdown waits for it.
LONGEST_JOB = settings.PTC_POLICY_SEED["max_timeout"] + settings.PTC_POLICY_SEED["max_client_wait"]


def _queue_of(command: list[str]) -> str | None:
    """The queue a `celery worker -Q <queue>` command serves, or None for another command."""
    if command[:4] != ["celery", "-A", "ptcproject", "worker"]:
        return None
    return command[command.index("-Q") + 1]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_the_compose_file_runs_every_process_on_postgres_and_redis() -> None:
    services = _compose()["services"]
    assert {"web", "exec", "tools", "beat", "postgres", "redis"} <= set(services)
    app_queues = {name: _queue_of(s["command"]) for name, s in services.items() if isinstance(s.get("command"), list)}
    assert app_queues["exec"] == queues.EXEC and app_queues["tools"] == queues.TOOLS
    routed = set(services["web"]["environment"]["PTC_TOOLS_QUEUES"].split(","))
    served = {q for q in app_queues.values() if q}
    assert routed | {queues.EXEC} == served  # every tools queue a toolset may name has its workers
    assert services["beat"]["command"][:4] == ["celery", "-A", "ptcproject", "beat"]
    web_env = services["web"]["environment"]
    assert web_env["DATABASE_URL"].startswith("postgres://") and web_env["CELERY_BROKER_URL"].startswith("redis://")
    # bubblewrap needs namespaces, which Docker's default seccomp profile refuses.
    assert "seccomp=unconfined" in services["exec"]["security_opt"]
    # Warm shutdown: the exec container's grace outlasts the longest job the policy allows.
    grace = int(re.fullmatch(r"(\d+)s", services["exec"]["stop_grace_period"]).group(1))  # type: ignore[union-attr]
    assert grace > LONGEST_JOB


def test_docker_compose_config_validates_the_file() -> None:
    if shutil.which("docker-compose"):
        command = ["docker-compose", "-f", str(DEPLOY / "compose.yaml"), "config", "-q"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        command = ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "-q"]
    else:  # make test installs it (scripts/deploy-deps.sh)
        raise AssertionError("neither docker-compose nor the docker compose plugin is installed (apt-get install docker-compose)")
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _kubernetes() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(Path(DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_kubernetes_has_a_keda_scaledobject_on_each_queues_redis_list() -> None:
    docs = _kubernetes()
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    prefix = config["PTC_REDIS_PREFIX"]
    workers = {}
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            queue = _queue_of(container["command"])
            if queue:
                workers[queue] = deployment
    assert set(workers) == {queues.EXEC, *config["PTC_TOOLS_QUEUES"].split(",")}
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    for queue, deployment in workers.items():
        scaler = scaled[deployment["metadata"]["name"]]
        assert scaler["apiVersion"] == "keda.sh/v1alpha1"
        (trigger,) = scaler["spec"]["triggers"]
        # Kombu's list for the queue, under the deployment's key prefix: what ptc_queue_depth reads.
        assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == f"{prefix}{queue}"
        assert int(trigger["metadata"]["listLength"]) > 0
    assert scaled["ptc-exec"]["spec"]["minReplicaCount"] >= 1  # the reaper runs in exec workers
    assert [d["spec"]["replicas"] for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ptc-beat"] == [1]
    # A tools pod's grace outlasts the soft shutdown it gets on SIGTERM (REMAP_SIGTERM=SIGQUIT).
    tools = workers[queues.TOOLS]["spec"]["template"]["spec"]
    assert {"name": "REMAP_SIGTERM", "value": "SIGQUIT"} in tools["containers"][0]["env"]
    assert tools["terminationGracePeriodSeconds"] > settings.CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT
    assert workers[queues.EXEC]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > LONGEST_JOB


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (or a folder holding it) out of the build context: ``**/``
    stands for any folders, none among them; ``*`` for any name; a later ``!pattern`` takes it back."""

    def regex(pattern: str) -> str:
        out = re.escape(pattern.strip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return f"{out}(?:/.*)?"

    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if re.fullmatch(regex(pattern.lstrip("!")), path):
            ignored = not negated
    return ignored


def test_the_image_holds_no_env_file() -> None:
    """README: put DJANGO_SECRET_KEY, PTC_SECRETS_KEYS and POSTGRES_PASSWORD in deploy/.env. The
    Dockerfile copies the whole repository, and that file was baked into every image's layers; a
    .env at the top (settings read it) went in too, and set what the compose file does not."""
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for secret in (".env", "deploy/.env", "deploy/kubernetes/.env"):
        assert _ignored(secret, patterns), secret
    for kept in ("manage.py", "ptcproject/settings.py", "requirements.txt", "deploy/compose.yaml"):
        assert not _ignored(kept, patterns), kept
    assert _ignored("var/db.sqlite3", patterns) and _ignored("execution/__pycache__/x.pyc", patterns)
