"""Settings, all read from the environment through one ``env`` (STYLE.md §9).

With no URLs configured the project runs on the embedded default: SQLite and kombu's filesystem
transport, under ``var/``. Give ``DATABASE_URL`` and ``CELERY_BROKER_URL``/``REDIS_URL`` to run on
PostgreSQL and Redis.
"""

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import environ

from execution.sandbox.limits import CALL_GRACE_SECONDS
from ptcproject import queues
from ptcproject.crypto import secrets_keys
from ptcproject.envvars import Env
from ptcproject.policy.seed import policy_seed

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
if (BASE_DIR / ".env").exists():
    env.read_env(str(BASE_DIR / ".env"))
# Every variable is read through one of these checked readers (ptcproject/envvars.py); a bad value
# is noted, and the end of this file stops start-up naming each bad variable and what it takes.
checked = Env()

DATA_DIR = checked.path("PTC_DATA_DIR", str(BASE_DIR / "var"))
try:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
except OSError as error:
    checked.require(
        False, f"PTC_DATA_DIR must be a folder this process can create and write; {error.strerror}: {error.filename}."
    )

DEBUG = checked.bool("DJANGO_DEBUG", False)
# The default key is for the embedded quickstart only; a deployment sets its own.
SECRET_KEY = env.str("DJANGO_SECRET_KEY", default="ptc-insecure-quickstart-key-change-me-0123456789")
checked.require(bool(SECRET_KEY.strip()), "DJANGO_SECRET_KEY must not be empty; unset it for the quickstart's key.")
# Fernet keys for toolset secrets at rest, comma-separated: the first encrypts, all decrypt. To rotate,
# put a new key first, keep the old after it, and run `manage.py ptc_rotate_secrets`. Unset, one key is
# derived from SECRET_KEY, for the quickstart (ptcproject/crypto.py). A bad key stops start-up, naming
# the variable.
PTC_SECRETS_KEYS: list[str] = checked.guard(
    lambda: secrets_keys(env.str("PTC_SECRETS_KEYS", default=""), secret_key=SECRET_KEY), []
)
ALLOWED_HOSTS = checked.list("DJANGO_ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])
# An empty list answers every request 400: never what an operator meant.
checked.require(bool(ALLOWED_HOSTS), "DJANGO_ALLOWED_HOSTS must list at least one host name (comma-separated).")
CSRF_TRUSTED_ORIGINS = checked.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])
# Django says so only in `manage.py check`, which the web never runs: an origin without its scheme
# was never matched, and every form of the admin behind the proxy was refused 403.
for _origin in CSRF_TRUSTED_ORIGINS:
    checked.require(
        urlsplit(_origin).scheme in ("http", "https") and bool(urlsplit(_origin).netloc),
        f"DJANGO_CSRF_TRUSTED_ORIGINS must list origins with their scheme (https://ptc.example.com); got {_origin!r}.",
    )

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "ptcproject.accounts",
    "ptcproject.policy",
    "tools",
    "execution",
    "billing",
]

MIDDLEWARE = [
    # First: the probes and /metrics answer a kubelet or Prometheus that sends the pod's IP as Host.
    "ptcproject.probes.AnyHostMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "ptcproject.api.LengthRequiredMiddleware",
    "ptcproject.api.OutageMiddleware",
]

ROOT_URLCONF = "ptcproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "ptcproject.wsgi.application"
ASGI_APPLICATION = "ptcproject.asgi.application"

DATABASE_SCHEMES = ("postgres", "postgresql", "pgsql", "sqlite")
DATABASES = {
    "default": environ.Env.db_url_config(checked.url("DATABASE_URL", f"sqlite:///{DATA_DIR / 'db.sqlite3'}", DATABASE_SCHEMES))
}
# Read whatever the database, so a bad value is found before the day PostgreSQL is switched on.
PTC_DB_PREPARE_AFTER = checked.int("PTC_DB_PREPARE_AFTER", 5, 0, 1_000_000)
# libpq reads 0 as "wait for ever": the very thing this timeout is here to prevent.
PTC_DB_CONNECT_TIMEOUT = checked.int("PTC_DB_CONNECT_TIMEOUT", 2, 1, 600)
PTC_DB_POOL_MIN = checked.int("PTC_DB_POOL_MIN", 2, 0, 1000)
PTC_DB_POOL_MAX = checked.int("PTC_DB_POOL_MAX", 20, 1, 1000)
checked.require(
    PTC_DB_POOL_MIN <= PTC_DB_POOL_MAX,
    f"PTC_DB_POOL_MAX ({PTC_DB_POOL_MAX}) must be at least PTC_DB_POOL_MIN ({PTC_DB_POOL_MIN}).",
)
PTC_DB_POOL_TIMEOUT = checked.float("PTC_DB_POOL_TIMEOUT", 2.0, 0, 3600, above_low=True)
# A statement that runs, or waits on a lock, longer than this is cancelled (PostgreSQL's
# statement_timeout, set on each pooled connection as it is made; migrate runs without it): a row
# locked by a stuck transaction fails the request (503 database_unavailable) or the task (retried)
# instead of holding it, and its worker thread, for as long as the lock is held. 0: PostgreSQL's own.
PTC_DB_STATEMENT_TIMEOUT = checked.float("PTC_DB_STATEMENT_TIMEOUT", 30.0, 0, 86400)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web, exec and tools workers write from separate processes: wait for the lock instead of
    # failing, and take it at BEGIN so two writers never deadlock on an upgrade.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A pool per process: Celery's Django fixup closes the connection around every task, which
    # without a pool costs a fresh PostgreSQL connection (~5 ms) on every tool call.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # Parameters travel apart from the SQL (server-side binding): psycopg need not build each query
    # string in Python. A statement run PTC_DB_PREPARE_AFTER times on a connection is prepared
    # there, so PostgreSQL stops parsing and planning it (Django turns this off by default):
    # a job's claim went from 0.84 to 0.47 ms. 0 turns it off, for a pooler that can't keep
    # prepared statements (PgBouncer before 1.22, or without max_prepared_statements).
    DATABASES["default"].setdefault("OPTIONS", {})["server_side_binding"] = True
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = PTC_DB_PREPARE_AFTER or None
    # A server that is down or unreachable is known within seconds, not after the OS's TCP timeout.
    DATABASES["default"]["OPTIONS"]["connect_timeout"] = PTC_DB_CONNECT_TIMEOUT
    DATABASES["default"]["OPTIONS"]["pool"] = {
        "min_size": PTC_DB_POOL_MIN,
        "max_size": PTC_DB_POOL_MAX,
        # How long a request waits for a connection: while PostgreSQL is down the API answers 503
        # database_unavailable after this, rather than hold the client. No view holds a
        # connection while it waits on something else, so a healthy pool hands one out in ms.
        "timeout": PTC_DB_POOL_TIMEOUT,
        # A connection that could not be made is tried again after 1, 2, 4, 8... s for this long,
        # and meanwhile no other is made for those waiting: after an outage of 20 s the pool went on
        # refusing for 9 s more (of a minute, up to a minute more). Given up after a second, the
        # next request makes one anew, within a second of PostgreSQL's return.
        "reconnect_timeout": 1.0,
    }
    # A connection that PostgreSQL dropped (a restart) is found and replaced when taken from the
    # pool, not handed to a query that fails; one used within the last second is trusted without
    # the round trip (ptcproject/pgcheck.py, through the backend ptcproject/postgres).
    DATABASES["default"]["ENGINE"] = "ptcproject.postgres"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

LOG_LEVEL = checked.choice("PTC_LOG_LEVEL", "info", ("debug", "info", "warning", "error", "critical")).upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"()": "ptcproject.logs.KeyValueFormatter", "format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "filters": {"not_mcp": {"()": "ptcproject.logs.DropFromPackage", "package": "mcp"}},
    "loggers": {
        "ptc": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
        # Unhandled errors in requests: a 500 must leave its traceback in the log.
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
        # httpx logs each request's status line at INFO: a tool server's reason phrase may echo a
        # secret header back (tools/kinds/http.py redacts it from what it reports).
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        # The mcp SDK's client logs what a server sent that it could not parse (a stdio server's
        # stdout line, an HTTP body) with pydantic's quote of it: a server may print its secrets.
        # The mcp kind logs its own line, naming the server (tools/kinds/mcp.py). Its ClientSession
        # logs as "client" (a notification it could not validate, quoted too): what the SDK's files
        # log there is dropped, and any other library's "client" lines are kept.
        "mcp.client": {"level": "CRITICAL"},
        "client": {"filters": ["not_mcp"]},
    },
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "ptcproject.accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # JSON in and out (API.md); a body nested too deep for the decoder is a 400, not a 500.
    "DEFAULT_PARSER_CLASSES": ["ptcproject.parsers.JsonParser"],
    "DEFAULT_PAGINATION_CLASS": "ptcproject.api.Pagination",
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "ptcproject.parsers.ContentNegotiation",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "ptcproject.api.exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "PTC backend API",
    "DESCRIPTION": "Programmatic Tool Calling: run agent-written Python that calls tools as functions.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI is served from the sidecar package, so /api/docs/ works offline (no CDN).
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "ptcproject.api.document_error_responses",
        "ptcproject.api.add_event_stream_path",
    ],
}

# --- Celery -------------------------------------------------------------------------------------
# Either URL alone names the Redis of the deployment: the other defaults to it (README). A broker
# left on the filesystem beside a Redis REDIS_URL would queue this process's jobs where no worker looks.
REDIS_URL = checked.url("REDIS_URL", "", ("redis", "rediss"))
CELERY_BROKER_URL = checked.url("CELERY_BROKER_URL", REDIS_URL or "filesystem://", ("filesystem", "redis", "rediss"))
REDIS_URL = REDIS_URL or (CELERY_BROKER_URL if CELERY_BROKER_URL.startswith("redis") else "")
EMBEDDED = CELERY_BROKER_URL.startswith("filesystem")
# Prefix for every Redis key and channel this deployment uses, so several can share one Redis
# (the test suite gives each run its own).
PTC_REDIS_PREFIX = env.str("PTC_REDIS_PREFIX", default="")
# No job may run longer than this, whatever the policy says: it sets the broker's visibility timeout,
# which must stay above the longest job, or a running job's message is handed to a second worker.
PTC_TIMEOUT_CEILING = checked.int("PTC_TIMEOUT_CEILING", 3600, 1, 7 * 24 * 3600)
CELERY_TASK_HARD_LIMIT = PTC_TIMEOUT_CEILING + 60

# JSON only: a message that reached the broker must never be able to run code (ARCHITECTURE.md).
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_SERIALIZER = "json"
# The database is the source of truth; nobody waits on a Celery result.
CELERY_TASK_IGNORE_RESULT = True
# Redelivered if a worker dies mid-task; every task claims its record first, so a rerun is harmless.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# One message at a time per free slot: a long job must not sit behind another in a prefetch buffer.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Exec tasks wait on sandboxes and tools tasks wait on I/O: threads, not processes, fit both.
# The number of threads is set per queue in ptcproject/celery.py unless -c is given.
CELERY_WORKER_POOL = "threads"
# Task events feed `celery events` and flower: observable by default (STYLE.md §14). Exec workers
# send them; tools workers only with PTC_TOOLS_TASK_EVENTS (every call already has its record and
# its live events, and three publishes per task cost a busy tools worker more than anything else),
# which also brings back Celery's per-task INFO lines there (each call logs its own line anyway).
# The "sent" event is left off: it would add a publish to every tool call's hot path.
CELERY_WORKER_SEND_TASK_EVENTS = True
PTC_TOOLS_TASK_EVENTS = checked.bool("PTC_TOOLS_TASK_EVENTS", False)
# A cold shutdown (SIGQUIT, or SIGTERM with REMAP_SIGTERM=SIGQUIT) first lets running tasks finish
# for this long, so a tools pod scaled down mid-call finishes its calls (keep it under the pod's grace).
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = checked.float("PTC_SOFT_SHUTDOWN_SECONDS", 60.0, 0, 24 * 3600)
# Don't let the worker hijack the root logger; our own handlers stay.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The most waiting tool calls a tools worker takes from Redis in one round trip (ptcproject/broker.py),
# never more than its free slots; 1 takes them one at a time, as kombu does. Exec workers take one
# job at a time (ptcproject/celery.py). Read on the embedded broker too, so a bad value is found
# before the day Redis is switched on.
PTC_BROKER_POP_MOST = checked.int("PTC_BROKER_POP_MOST", 16, 1, 1000)
if EMBEDDED:
    # kombu's filesystem transport with atomic message writes (ptcproject/broker.py).
    CELERY_BROKER_TRANSPORT = "ptcproject.broker:FilesystemTransport"
    _broker_dir = DATA_DIR / "broker"
    for _folder in ("queue", "processed", "control"):
        try:
            (_broker_dir / _folder).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # PTC_DATA_DIR itself could not be made: noted above
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # One folder in and out: every process on this host reads and writes the same queues.
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
        # The filesystem transport can only poll; keep the interval short for the quickstart.
        "polling_interval": 0.02,
    }
else:
    if CELERY_BROKER_URL.startswith("redis://"):
        # kombu's Redis transport with a fix for losing the connection mid-job (ptcproject/broker.py).
        CELERY_BROKER_TRANSPORT = "ptcproject.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Above the longest hard time limit, or a running task is redelivered to a second worker.
        "visibility_timeout": CELERY_TASK_HARD_LIMIT + 300,
        "global_keyprefix": PTC_REDIS_PREFIX,
        "pop_most": PTC_BROKER_POP_MOST,
        # How long a stopping worker waits for a full Redis to take back the messages it took while
        # Redis was full and did not run (Redis has no copy of them): as long as a cold shutdown
        # lets running tasks finish, within the pod's grace (ptcproject/broker.py).
        "restore_wait": CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT,
    }
# How often beat runs the reaper that ends jobs whose worker died (ARCHITECTURE.md, "no job stays running").
PTC_REAP_EVERY = checked.float("PTC_REAP_EVERY", 15.0, 0, 24 * 3600, above_low=True)
# Retention: a finished job's code, output, return value and its tool calls' inputs and outputs are
# emptied this many days after it finished (the rows and every charge stay). Unset: kept forever. A
# user's own setting (admin, "User settings") overrides it; 0 purges at the next round.
PTC_RETENTION_DAYS: int | None = (
    checked.int("PTC_RETENTION_DAYS", 0, 0, 100 * 366) if env.str("PTC_RETENTION_DAYS", default="").strip() else None
)
# How often beat runs the purge: the longest a zero-retention user's finished job keeps its data.
PTC_RETENTION_EVERY = checked.float("PTC_RETENTION_EVERY", 60.0, 0, 24 * 3600, above_low=True)
# Each round expires once the next is due: rounds sent while no worker was up are dropped, not all
# run at once by the first worker back (each does the whole round's work again, for nothing).
CELERY_BEAT_SCHEDULE = {
    "reap-stuck-jobs": {"task": "execution.tasks.reap_jobs", "schedule": PTC_REAP_EVERY, "options": {"expires": PTC_REAP_EVERY}},
    "purge-old-jobs": {
        "task": "execution.tasks.purge_jobs",
        "schedule": PTC_RETENTION_EVERY,
        "options": {"expires": PTC_RETENTION_EVERY},
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
# The queues a toolset may route its calls to (Toolset.queue), each served by its own
# `celery worker -Q <name>`: "tools" always, plus e.g. "tools.slow" for slow MCP servers.
PTC_TOOLS_QUEUES: list[str] = checked.list("PTC_TOOLS_QUEUES", default=[queues.TOOLS])
# Nor maintenance: every worker consumes it, an exec worker too, which would run a tool's calls.
checked.require(
    queues.TOOLS in PTC_TOOLS_QUEUES and not {queues.EXEC, queues.MAINTENANCE} & set(PTC_TOOLS_QUEUES),
    f"PTC_TOOLS_QUEUES must list '{queues.TOOLS}' and must not list '{queues.EXEC}' or '{queues.MAINTENANCE}'.",
)
# Metrics (ptcproject/metrics.py). /metrics answers a bearer PTC_METRICS_TOKEN or a staff API key.
# A worker serves its own on PTC_METRICS_PORT unless PROMETHEUS_MULTIPROC_DIR (read by
# prometheus_client itself) gathers every process's values for the web's /metrics.
# Stripped, as the request's is: a token from a file (a Kubernetes Secret) ends with a newline, and
# no scrape matched it.
PTC_METRICS_TOKEN = env.str("PTC_METRICS_TOKEN", default="").strip()
# Read by prometheus_client and OpenTelemetry themselves, later: checked here, so a folder that is
# not there fails start-up naming it, not every process's first metric deep in prometheus_client,
# and an endpoint that is no URL is not found only in the exporter's thread at the first job's end.
checked.folder("PROMETHEUS_MULTIPROC_DIR")
if env.str("OTEL_EXPORTER_OTLP_ENDPOINT", default="").strip():
    checked.url("OTEL_EXPORTER_OTLP_ENDPOINT", "", ("http", "https"))
PTC_METRICS_PORT = checked.int("PTC_METRICS_PORT", 0, 0, 65535)
# Threads per worker process when -c is not given on the command line.
PTC_EXEC_CONCURRENCY = checked.int("PTC_EXEC_CONCURRENCY", 8, 1, 1024)
PTC_TOOLS_CONCURRENCY = checked.int("PTC_TOOLS_CONCURRENCY", 64, 1, 4096)

# --- Sandbox and job limits ---------------------------------------------------------------------
# Interpreter the sandbox runs: Debian's, which an unprivileged uid can read and which starts fast.
PTC_SANDBOX_PYTHON = str(checked.path("PTC_SANDBOX_PYTHON", "/usr/bin/python3"))
PTC_BWRAP = str(checked.path("PTC_BWRAP", "/usr/bin/bwrap"))
# Where generated SDKs and the runner are staged for bind-mounting; readable by the sandbox uid.
PTC_SANDBOX_DIR = checked.path("PTC_SANDBOX_DIR", "/tmp/ptc-sandbox")
# Sandboxes each exec worker keeps started and waiting for a job (each is used once): a job does
# not wait for bubblewrap and an interpreter to start. 0 starts each one when its job comes.
PTC_SANDBOX_POOL_SIZE = checked.int("PTC_SANDBOX_POOL_SIZE", 2, 0, 256)
PTC_MAX_CODE_BYTES = 256 * 1024
PTC_MAX_WAIT = 60
# The rollout policy's first values (PTC_MODE, PTC_TIMEOUT, PTC_MAX_TOOL_CALLS, ...); see
# ptcproject/policy/seed.py. After the row exists, the admin and PATCH /api/v1/policy own it.
PTC_POLICY_SEED: dict[str, Any] = checked.guard(lambda: policy_seed(env, timeout_ceiling=PTC_TIMEOUT_CEILING), {})
# Counts threads as well as processes (RLIMIT_NPROC): room for a pool of 100 threads calling tools.
PTC_MAX_PROCESSES = checked.int("PTC_MAX_PROCESSES", 256, 1, 1_000_000)
PTC_MAX_FILE_MB = checked.int("PTC_MAX_FILE_MB", 64, 1, 1024 * 1024)
PTC_MAX_OPEN_FILES = checked.int("PTC_MAX_OPEN_FILES", 256, 16, 1_000_000)
# A tool's arguments and its output are each held to this; a bridge frame carries one of them.
PTC_MAX_TOOL_OUTPUT_BYTES = checked.int("PTC_MAX_TOOL_OUTPUT_BYTES", 1024 * 1024, 1024, 256 * 1024 * 1024)
PTC_MAX_FRAME_BYTES = PTC_MAX_TOOL_OUTPUT_BYTES + 64 * 1024
# The most one job's tool calls may pass, arguments and results together: every view of a job
# (its exec_end event, GET, MCP's result) carries each call's whole input and output.
PTC_MAX_JOB_TOOL_BYTES = checked.int("PTC_MAX_JOB_TOOL_BYTES", 64 * 1024 * 1024, 0, 1 << 40)
# The largest request body read: room for code at PTC_MAX_CODE_BYTES even if JSON escapes every byte
# (\u00XX is six), or for a tool call's arguments at their limit. Over it the API answers 413
# code_too_large (ptcproject.api); under it, a service checks the code's own size.
DATA_UPLOAD_MAX_MEMORY_SIZE = max(6 * PTC_MAX_CODE_BYTES, PTC_MAX_TOOL_OUTPUT_BYTES) + 64 * 1024
# What the worker buffers for one job (replies the code has not read, calls waiting for a slot).
PTC_MAX_BUFFERED_BYTES = checked.int("PTC_MAX_BUFFERED_BYTES", 32 * 1024 * 1024, PTC_MAX_FRAME_BYTES, 2**40)
# A job still queued after this long lost its queue message: the reaper fails it.
PTC_QUEUED_MAX_SECONDS = checked.int("PTC_QUEUED_MAX_SECONDS", 1800, 60, 7 * 24 * 3600)
# Sessions (README, "Sessions"): a sandbox kept between jobs on one exec worker, whose jobs reach it
# through that worker's direct queue (<nodename>.dq2).
CELERY_WORKER_DIRECT = True
PTC_MAX_SESSIONS_PER_USER = checked.int("PTC_MAX_SESSIONS_PER_USER", 4, 0, 10_000)
# The sessions' sandboxes one exec worker keeps at most, each up to its memory limit: past it, a
# new session's first job there ends the session that has been idle longest (``expired``).
PTC_SESSIONS_PER_WORKER = checked.int("PTC_SESSIONS_PER_WORKER", 32, 1, 100_000)
# A user's own keys that work (not revoked, not expired) one may make over the API: each is a row
# kept for good (its audit trail with it), so a key may not make them without end.
PTC_MAX_KEYS_PER_USER = checked.int("PTC_MAX_KEYS_PER_USER", 100, 1, 100_000)
# Managed containers' jobs (README, "Client tools and approvals"): each is made by a container's
# first call (POST /tools/execute with container_id, the client's choice), so one user may hold at
# most this many open (0: no bound), and one with no call for PTC_CONTAINER_IDLE_SECONDS is closed
# by the reaper (0: never).
PTC_MAX_CONTAINERS_PER_USER = checked.int("PTC_MAX_CONTAINERS_PER_USER", 16, 0, 100_000)
PTC_CONTAINER_IDLE_SECONDS = checked.int("PTC_CONTAINER_IDLE_SECONDS", 3600, 0, 365 * 24 * 3600)
PTC_SESSION_IDLE_TIMEOUT = checked.float("PTC_SESSION_IDLE_TIMEOUT", 600.0, 0, 365 * 24 * 3600, above_low=True)
PTC_SESSION_MAX_IDLE_TIMEOUT = checked.float("PTC_SESSION_MAX_IDLE_TIMEOUT", 3600.0, 0, 365 * 24 * 3600, above_low=True)
PTC_SESSION_MAX_LIFETIME = checked.float("PTC_SESSION_MAX_LIFETIME", 3600.0, 0, 365 * 24 * 3600, above_low=True)
PTC_SESSION_MAX_MAX_LIFETIME = checked.float("PTC_SESSION_MAX_MAX_LIFETIME", 24 * 3600.0, 0, 365 * 24 * 3600, above_low=True)
# A default above its most would make every session that takes the default a 400.
checked.require(
    PTC_SESSION_IDLE_TIMEOUT <= PTC_SESSION_MAX_IDLE_TIMEOUT,
    f"PTC_SESSION_IDLE_TIMEOUT ({PTC_SESSION_IDLE_TIMEOUT:g}) must be at most "
    f"PTC_SESSION_MAX_IDLE_TIMEOUT ({PTC_SESSION_MAX_IDLE_TIMEOUT:g}).",
)
checked.require(
    PTC_SESSION_MAX_LIFETIME <= PTC_SESSION_MAX_MAX_LIFETIME,
    f"PTC_SESSION_MAX_LIFETIME ({PTC_SESSION_MAX_LIFETIME:g}) must be at most "
    f"PTC_SESSION_MAX_MAX_LIFETIME ({PTC_SESSION_MAX_MAX_LIFETIME:g}).",
)
# Files of /work kept in the database (a session's, or a job's inputs and outputs): at most this many
# bytes in all and this many files, per session or per job.
PTC_FILES_MAX_BYTES = checked.int("PTC_FILES_MAX_BYTES", 8 * 1024 * 1024, 0, 1024 * 1024 * 1024)
PTC_FILES_MAX_COUNT = checked.int("PTC_FILES_MAX_COUNT", 100, 0, 10_000)
# A running job refreshes its lease this often; the reaper fails jobs whose lease has run out.
PTC_JOB_HEARTBEAT_SECONDS = checked.int("PTC_JOB_HEARTBEAT_SECONDS", 10, 1, 3600)
PTC_JOB_LEASE_SECONDS = checked.int("PTC_JOB_LEASE_SECONDS", 45, 2, 24 * 3600)
# A lease no longer than the beat that renews it lapses between two renewals: the reaper would
# fail healthy running jobs as WorkerLost.
checked.require(
    PTC_JOB_LEASE_SECONDS >= 2 * PTC_JOB_HEARTBEAT_SECONDS,
    f"PTC_JOB_LEASE_SECONDS ({PTC_JOB_LEASE_SECONDS}) must be at least twice "
    f"PTC_JOB_HEARTBEAT_SECONDS ({PTC_JOB_HEARTBEAT_SECONDS}).",
)
# A call over HTTP with a job's key holds a slot of its job's parallel cap from its bridge's
# admission: its bridge looks for its record at the first heartbeat two after (up to three beats
# on), and fences off one not recorded (its web process dead or stalled) before it gives its slot
# up (Session._key_calls_check); past its tool's timeout (0.1 s at least) and twice the grace, it
# gives it up unfenced. Were three beats longer, a stalled web process would record and run the call
# after its slot was given away (no epoch raised): the cap passed, and the call counted twice (its
# Admitted counts a call the bridge no longer holds).
checked.require(
    3 * PTC_JOB_HEARTBEAT_SECONDS < 2 * CALL_GRACE_SECONDS,
    f"PTC_JOB_HEARTBEAT_SECONDS ({PTC_JOB_HEARTBEAT_SECONDS}) must be under {2 * CALL_GRACE_SECONDS / 3:g} s: a job's bridge "
    "looks for the record of a call over HTTP with its key up to three heartbeats after admitting it, and must do so "
    f"before it gives the call's slot up, {2 * CALL_GRACE_SECONDS:g} s past its tool's timeout.",
)
# How long a worker keeps trying to record a job's end while the database is unreachable; after
# that the job's lease lapses and the reaper ends it once the database is back.
PTC_DB_RETRY_SECONDS = checked.float("PTC_DB_RETRY_SECONDS", 60.0, 0, 24 * 3600)
PTC_DEFAULT_TOOL_TIMEOUT = checked.int("PTC_DEFAULT_TOOL_TIMEOUT", 60, 1, 24 * 3600)
# How long a client tool's call waits for its result, and a call for its approval, unless the tool
# says otherwise (Anthropic's managed PTC gives a client about 4 minutes).
PTC_CLIENT_TOOL_TIMEOUT = checked.int("PTC_CLIENT_TOOL_TIMEOUT", 240, 1, 7 * 24 * 3600)
# The most client tools one job may declare, and the size of their definitions as JSON.
PTC_MAX_CLIENT_TOOLS = checked.int("PTC_MAX_CLIENT_TOOLS", 64, 0, 10_000)
PTC_MAX_CLIENT_TOOLS_BYTES = checked.int("PTC_MAX_CLIENT_TOOLS_BYTES", 256 * 1024, 0, 64 * 1024 * 1024)
# How long a finished job's event stream stays in Redis; after that it is rebuilt from the records.
PTC_EVENTS_RETENTION_SECONDS = checked.int("PTC_EVENTS_RETENTION_SECONDS", 3600, 1, 30 * 24 * 3600)
# A quiet event stream sends a comment this often, so proxies and clients know it is alive.
PTC_EVENTS_HEARTBEAT_SECONDS = checked.float("PTC_EVENTS_HEARTBEAT_SECONDS", 15.0, 0, 3600, above_low=True)
# Event streams and MCP calls following their job one user may have open at once, per process:
# each holds a Redis connection (execution.events.follow_admit).
PTC_EVENT_STREAMS_PER_USER = checked.int("PTC_EVENT_STREAMS_PER_USER", 32, 1, 10_000)
# MCP over HTTP (/mcp): a session no request has used for this long is closed, and one user may
# have this many open at once (the SDK's own cap is one for the whole process).
PTC_MCP_SESSION_IDLE_SECONDS = checked.float("PTC_MCP_SESSION_IDLE_SECONDS", 300.0, 0, 7 * 24 * 3600, above_low=True)
PTC_MCP_SESSIONS_PER_USER = checked.int("PTC_MCP_SESSIONS_PER_USER", 16, 1, 10_000)
# Where people reach the admin, for links the CLI prints.
PTC_PUBLIC_URL = checked.url("PTC_PUBLIC_URL", "http://127.0.0.1:8000", ("http", "https"))

checked.stop()
