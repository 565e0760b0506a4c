from django.apps import AppConfig


class PolicyConfig(AppConfig):
    name = "ptcproject.policy"
    label = "policy"
    verbose_name = "Rollout policy"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from ptcproject.policy.services import policy_ensure

        # The policy row is seeded once, at `migrate`, from the PTC_* variables; reads never write.
        post_migrate.connect(lambda **_: policy_ensure(), sender=self, weak=False)
