"""The controller's task storage: the task (``tasks``), the in-memory table of live tasks
(``table``) with its finished ones (``history``) and journal (``journal``, ``migrate``), the
durable task store (``store`` over SQLite ``store_sql``; ``python -m
controller.tasks.store_check``) and the denoising checkpoints the controller keeps
(``checkpoints``). It imports nothing else of the controller.
"""
