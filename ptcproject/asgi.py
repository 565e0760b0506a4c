import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")
# The admin's and Swagger UI's assets come from the installed apps, served by Django itself, so
# `uvicorn ptcproject.asgi:application` is all it takes: no collectstatic, no CDN.
django_application = ASGIStaticFilesHandler(get_asgi_application())

# Imported once the apps are loaded: it reaches the models. /mcp is the MCP server; the rest is Django.
from execution.mcp_http import with_mcp  # noqa: E402

application = with_mcp(django_application)
