from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ptcproject.accounts.services import user_with_key_create
from ptcproject.errors import ApplicationError


class Command(BaseCommand):
    help = "Create an API key for a user. The key is printed as the last line of stdout."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--create-user", action="store_true", help="Create the user if it does not exist.")
        parser.add_argument("--staff", action="store_true", help="Make the user staff.")
        parser.add_argument("--credits", type=int, default=0, help="Credits to grant, through the ledger.")
        parser.add_argument("--name", default="", help="A label for the key.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["credits"] < 0:
            raise CommandError("--credits must be zero or more.")
        try:
            user, plaintext = user_with_key_create(
                username=options["username"],
                create_user=options["create_user"],
                staff=options["staff"],
                name=options["name"],
                credits=options["credits"],
            )
        except LookupError as exc:
            raise CommandError(str(exc)) from exc
        except ApplicationError as exc:  # a username, name or amount it can't take
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        self.stdout.write(f"Created an API key for '{user.username}'{' (staff)' if user.is_staff else ''}.")
        self.stdout.write(plaintext)
