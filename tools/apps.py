from django.apps import AppConfig


class ToolsConfig(AppConfig):
    name = "tools"
    verbose_name = "Toolsets and tools"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from tools.services import builtin_toolsets_sync

        # Builtin toolsets are registered in code; `migrate` creates or updates their rows, so
        # `demo` exists right after `python manage.py migrate` with no extra step (PRODUCT.md).
        post_migrate.connect(lambda **_: builtin_toolsets_sync(), sender=self, weak=False)
