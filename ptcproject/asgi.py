import os

from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")
# The admin's and Swagger UI's assets come from the installed apps, served by Django itself, so
# `uvicorn ptcproject.asgi:application` is all it takes: no collectstatic, no CDN.
application = ASGIStaticFilesHandler(get_asgi_application())
