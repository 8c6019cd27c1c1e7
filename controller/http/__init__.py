"""The controller's HTTP edge: the web app (``webapp``) and what it is made of.

The front door (``frontdoor``: turns a request into a task and answers status from the task
table), the route modules that translate HTTP to it and back (the task API ``routes``,
OpenAI's ``routes_openai`` / ``openai_api``, events ``events`` / ``routes_events``, the status
page ``routes_ui`` + ``ui/``), the request bodies and their checks (``schemas``, ``forms``,
``bodies``, ``auth``, ``dit_offers``), image decoding in processes of its own (``decoding``)
and thumbnails (``thumbs``). It may use the ownership logic and the task storage below it;
nothing below imports it.
"""
