from django.apps import AppConfig


class PolicyConfig(AppConfig):
    name = "ptcproject.policy"
    label = "policy"
    verbose_name = "Rollout policy"
