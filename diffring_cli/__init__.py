"""The ``diffring`` command line: ``serve`` (a service, as ``run_service.py``), ``inspect``
(the rings of a running controller) and ``submit`` (post a task over HTTP, show its
progress from the events, save the result). See :mod:`diffring_cli.main`."""
