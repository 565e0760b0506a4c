from django.urls import path

from billing import apis

urlpatterns = [
    path("billing/balance", apis.BalanceApi.as_view(), name="billing-balance"),
    path("billing/usage", apis.UsageListApi.as_view(), name="billing-usage"),
    path("billing/credits", apis.CreditsApi.as_view(), name="billing-credits"),
]
