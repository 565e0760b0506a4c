"""What an operator does in the admin to a live fleet: each action leaves every job able to end."""

import time
import uuid

from django.contrib.auth import get_user_model
from django.test import Client

from execution.models import ExecJob
from tests.conftest import Api


def test_the_admin_cancels_a_running_job_it_tells_the_operator_to_cancel(api: Api) -> None:
    """The admin deletes no job that has not ended, and says "cancel it first"; it had no way to
    cancel one (a managed container's job runs until someone does). Its action cancels the jobs
    chosen as POST /exec/{id}/cancel does, and leaves those that have ended as they are."""
    staff = get_user_model().objects.create_user(username=f"ops-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    done = api.run("1", wait=30)
    job = api.post("/api/v1/exec", json={"code": "import time\ntime.sleep(60)", "wait": 0}).json()
    deadline = time.monotonic() + 30
    while ExecJob.objects.get(pk=job["id"]).status != "running":
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)
    action = {"action": "cancel_jobs", "_selected_action": [job["id"], done["id"]]}
    try:
        page = client.post("/admin/execution/execjob/", action, follow=True).content.decode()
        assert f"Cancelled {job['call_id']}" in page and f"Not cancelled: {done['call_id']} had ended (completed)" in page
        deadline = time.monotonic() + 20
        while (row := ExecJob.objects.get(pk=job["id"])).closed_at is None:  # its worker kills the sandbox, closes it
            assert time.monotonic() < deadline, row.status
            time.sleep(0.2)
        seen = api.get(f"/api/v1/exec/{job['id']}").json()
        assert (seen["status"], seen["error"]["type"]) == ("cancelled", "Cancelled")
        assert api.get(f"/api/v1/exec/{done['id']}").json()["status"] == "completed"
    finally:
        api.post(f"/api/v1/exec/{job['id']}/cancel")
