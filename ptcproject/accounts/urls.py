from django.urls import path

from ptcproject.accounts import apis

urlpatterns = [
    path("keys", apis.ApiKeyListCreateApi.as_view(), name="key-list"),
    path("keys/<uuid:key_id>", apis.ApiKeyDetailApi.as_view(), name="key-detail"),
    path("keys/<uuid:key_id>/revoke", apis.ApiKeyRevokeApi.as_view(), name="key-revoke"),
]
