"""Who owns each task at every instant: the coordinator and its parts.

``coordinator`` states the ownership argument window by window and composes the parts, each
one job: the worker registry (``registry``), admission of new tasks (``admission``), claims
and leases (``claims``, ``leases``), completions and result files (``completions``,
``results``, ``result_writes``), requeue and release order (``requeue``), recovery and the
retry budget (``recovery``, ``budget``), reconciliation against the rings (``reconcile``),
priorities and preemption (``priorities``), who may keep a checkpoint and where a task
resumes (``resumes``), the measured completion rate (``rates``). It uses the task storage
below it and never the HTTP edge above.
"""
