"""The long-lived processes' heap: what start-up made is frozen out of the collector's sight.

A web or worker process holds some 120,000 to 170,000 objects the collector tracks from its start
(Django, DRF, Celery, kombu, the models, the URLconf), and each full collection walked them all
again: 30-120 ms holding the process's GIL, every few dozen jobs, landing on whatever job or call
ran then (back-to-back submits had a slowest of 136-180 ms; 44-48 ms with them frozen).
``gc.freeze()`` moves them to a permanent generation the collector never scans; what the process
makes later is collected as before. The fork server does the same before it forks (zygote.py).
"""

import gc


def heap_freeze() -> None:
    """Collect once, then freeze every object that survived: call it once start-up is done."""
    gc.collect()
    gc.freeze()
