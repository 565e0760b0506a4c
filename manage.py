#!/usr/bin/env python
import logging
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ptcproject.settings")
    from django.core.management import execute_from_command_line
    from django.db import OperationalError

    # The pool's warning at each failed attempt ("error connecting in 'pool-1'", two lines each):
    # a command that can't reach the database says so once, below.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    try:
        execute_from_command_line(sys.argv)
    except OperationalError:
        # A database that can't be reached (down, a wrong host or password) is one line saying why,
        # as a bad variable is, not a traceback through the pool; --traceback still shows it.
        from ptcproject.db import db_unreachable_reason

        reason = None if "--traceback" in sys.argv else db_unreachable_reason()
        if reason is None:
            raise
        sys.exit(f"manage.py {' '.join(sys.argv[1:2])}: {reason}")


if __name__ == "__main__":
    main()
