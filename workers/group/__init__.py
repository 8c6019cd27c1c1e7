"""A transformer group: one DiT worker made of G processes, one per device.

* :mod:`workers.group.supervisor`: the ``run_service.py --service transformer --devices ...``
  process; starts the ranks, watches them, takes the group down as one and restarts it.
* :mod:`workers.group.rank`: one rank's process; rank 0 is the worker the runtime sees
  (:mod:`workers.group.leader`), the others follow its commands (:mod:`workers.group.follower`).
* :mod:`workers.group.dist`: the torch process group and the rank-to-rank command channel.
* :mod:`workers.group.steps`: what every rank runs for one command, and how rank 0 judges
  the outcome (in step, or broken).

The model side (CFG split, diffusers' context parallelism) is :mod:`workers.models.dit.parallel`.
"""
