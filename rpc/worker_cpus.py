"""A worker's CPUs, settled in its ``__main__`` before torch is imported: pin the process
to ``--cpus`` (the launcher's core plan, ``gateway.core_plan``) and turn
``--num-threads 0`` into the team its budget fits (``engine.cpu_budget``: the affinity
mask, the cgroup quota and ``--cpu-limit``, which the chart sets from the container's CPU
limit). The worker pins itself, rather than its launcher doing it between fork and exec
(a ``preexec_fn`` runs Python in a forked child and crashed workers started while the
launcher's gRPC threads ran). Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging

from engine.cpu_budget import format_cpu_list, pin_process, read_cpu_budget
from rpc.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


def settle_cpus(cfg: WorkerConfig) -> WorkerConfig:
    """Pin to ``cfg.cpus`` (if given) and return ``cfg`` with ``engine.num_threads``
    resolved (> 0). ValueError if the CPUs cannot be used."""
    if cfg.cpus:
        pin_process(cfg.cpus)
    budget = read_cpu_budget(limit_cores=cfg.cpu_limit)
    threads = cfg.engine.num_threads or budget.cores
    logger.info(
        "CPU budget: cpus %s, cgroup quota %s, stated limit %s -> %d compute threads%s",
        format_cpu_list(budget.cpus),
        "none" if budget.quota_cores is None else f"{budget.quota_cores:g} cores",
        "none" if budget.limit_cores is None else f"{budget.limit_cores:g} cores",
        threads,
        "" if cfg.engine.num_threads else " (--num-threads 0: from the budget)",
    )
    if threads > budget.cores:
        logger.warning(
            "--num-threads %d exceeds this process's CPU budget of %d cores: its compute "
            "team will contend with itself",
            threads,
            budget.cores,
        )
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_threads=threads))
