"""Writes for execution, one module per lifecycle:

- ``jobs``: an exec job is created, run in its sandbox, finished, cancelled, reaped;
- ``calls``: a tool call is checked, recorded, reserved, enqueued, claimed, run, finished and
  charged (billing.services holds the ledger), and reaped when its worker dies;
- ``router``: the bridge adapter between a job's sandbox session and ``calls``.
"""
