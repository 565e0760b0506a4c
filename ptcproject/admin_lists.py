"""The admin's lists over tables of millions of rows."""

from django.contrib import admin

from ptcproject.paging import EstimatingPaginator


class LargeListAdmin(admin.ModelAdmin):
    """A ModelAdmin whose list is counted as ptcproject.paging counts (exactly up to 10,000 rows,
    PostgreSQL's estimate past them, drawn "about N"), and once a load: Django's paginator counted
    every row of the list, and with ``show_full_result_count`` every row of the table again, each
    load (the calls, jobs or ledger of a large deployment, past PTC_DB_STATEMENT_TIMEOUT: the page
    failed). Every admin of ours is one (tests/test_admin_lists.py checks)."""

    paginator = EstimatingPaginator
    show_full_result_count = False
