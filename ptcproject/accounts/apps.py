from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "ptcproject.accounts"
    label = "accounts"
    verbose_name = "Users and API keys"
