from django.db import transaction

from tools.builtin import registry
from tools.models import Tool, Toolset


@transaction.atomic
def builtin_toolsets_sync() -> None:
    """Create or update the rows of every builtin toolset from the code registry.

    Tools no longer in the code are disabled, not deleted, so the calls recorded against them
    keep pointing at a row.
    """
    for spec in registry().values():
        toolset, _ = Toolset.objects.update_or_create(
            key=spec.key,
            owner=None,
            defaults={
                "name": spec.name,
                "description": spec.description,
                "kind": Toolset.Kind.BUILTIN,
                "is_global": True,
                "price": spec.price,
                "billing_free": spec.billing_free,
            },
        )
        for tool in spec.tools:
            Tool.objects.update_or_create(
                toolset=toolset,
                name=tool.name,
                defaults={
                    "description": tool.description,
                    "input_schema": tool.input_schema,
                    "output_schema": tool.output_schema,
                    "allowed_callers": [Tool.Caller.CODE_EXECUTION],
                    "read_only": tool.read_only,
                    "price": tool.price,
                    "billing_free": tool.billing_free,
                    "enabled": True,
                },
            )
        toolset.tools.exclude(name__in=[t.name for t in spec.tools]).update(enabled=False)
