from django.urls import path

from ptcproject.policy import apis

urlpatterns = [path("policy", apis.PolicyApi.as_view(), name="policy")]
