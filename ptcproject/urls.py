from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from ptcproject import probes
from ptcproject.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", probes.healthz),
    path("readyz", probes.readyz),
    path("metrics", metrics_view),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("api/v1/", include("execution.urls")),
    path("api/v1/", include("ptcproject.policy.urls")),
    path("api/v1/", include("billing.urls")),
    path("api/v1/", include("tools.urls")),
    path("api/v1/", include("ptcproject.accounts.urls")),
]

handler400 = "ptcproject.api.bad_request"
handler404 = "ptcproject.api.not_found"
handler500 = "ptcproject.api.server_error"
