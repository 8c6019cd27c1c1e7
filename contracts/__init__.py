"""What both sides of the wire agree on: the controller and the workers import this, never
each other.

- :mod:`contracts.errors` — the one exception tree (root and ring part from ``rings``).
- :mod:`contracts.pipelines` — the pipeline table and the settings lists (dtypes, backends).
- :mod:`contracts.request` — the task schema, :class:`~contracts.request.GenerationRequest`.
- :mod:`contracts.roles` — the :class:`~contracts.roles.Role` enum and each role's rings.
- :mod:`contracts.messages` — ring payload kinds and control-channel operations.
- :mod:`contracts.config` — a service's configuration file; its metadata-plane section is
  :mod:`contracts.disagg`, the strict reader of every section :mod:`contracts.configio`, the
  cluster token's development default and its refusal off loopback
  :mod:`contracts.cluster_token`.
- :mod:`contracts.metrics` — the metrics endpoint and gauge helpers.

May import ``rings``; imports no model library (no torch, diffusers or transformers).
"""
