"""Several supervised MITM children (``EGRESSD_MITM_WORKERS``), one :class:`MitmSupervisor` each.

Worker ``i`` listens on ``OPENSANDBOX_EGRESS_MITMPROXY_PORT + i`` and is started, watched and
restarted on its own (the existing backoff; the CA is re-checked before each restart), so one
crash never touches the others. The kernel sends each subject to one worker (the fleet's
``mitm_port_v4/v6`` maps, uid subjects by their port): while a worker is down nothing listens
on its port and its subjects' intercepted connections are refused (fail closed), never passed.

The pool answers like one supervisor where the daemon asks one (``ready``, ``forget``, ``run``,
``stop``, ``wait_ready``): ready means every worker is; forgets go to every worker, which is
simpler than tracking which worker holds a client, and safe (a forget is only ever a drop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from egressd.fleetnft.workers import uid_worker
from egressd.kernel.listeners import raise_fd_limit
from egressd.metrics import EgressMetrics
from egressd.mitm.handover import Listen
from egressd.mitm.supervisor import MitmOptions, MitmSupervisor, mitmdump_argv


def worker_options(opts: MitmOptions, workers: int) -> list[MitmOptions]:
    """Each worker's options (pure): its own port, and the host-uid subject ports of the
    slots it serves (slot % workers == i), so every port keeps exactly one listener."""
    first = opts.subject_ports[0] if opts.subject_ports else 0
    out: list[MitmOptions] = []
    for i in range(workers):
        mine = tuple(p for p in opts.subject_ports if uid_worker(p - first, workers) == i)
        out.append(replace(opts, port=opts.port + i, subject_ports=mine))
    return out


def not_ready_message(workers: Sequence[int]) -> str | None:
    if not workers:
        return None
    if len(workers) == 1:
        return f"mitm worker {workers[0]} not ready"
    return f"mitm workers {', '.join(str(w) for w in workers)} not ready"


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    worker: int
    port: int
    pid: int | None
    ready: bool
    starts: int


class MitmPool:
    def __init__(self, supervisors: Sequence[MitmSupervisor], ports: Sequence[int]) -> None:
        if not supervisors or len(supervisors) != len(ports):
            raise ValueError("one port per worker, at least one worker")
        self.workers = list(supervisors)
        self.ports = tuple(ports)

    @classmethod
    def build(
        cls,
        opts: MitmOptions,
        workers: int,
        *,
        gid: int | None = None,
        metrics: EgressMetrics | None = None,
        before_restart: Callable[[], None] | None = None,
    ) -> MitmPool:
        each = worker_options(opts, workers)
        # egressd binds every worker's listeners (docs/reference/behaviour.md §20.1): room for them.
        raise_fd_limit()
        sups = [
            MitmSupervisor(
                mitmdump_argv(o),
                gid=gid,
                metrics=metrics,
                before_restart=before_restart,
                worker=i,
                listen=Listen((o.port, *o.subject_ports), opts.listen_mark),
            )
            for i, o in enumerate(each)
        ]
        pool = cls(sups, [o.port for o in each])
        if metrics is not None:
            pool.watch(metrics)
        return pool

    def watch(self, metrics: EgressMetrics) -> None:
        """The per-worker gauges, computed at scrape time."""
        metrics.mitm_ready.collect_from(
            lambda: {(str(s.worker),): 1.0 if s.ready else 0.0 for s in self.workers}
        )
        metrics.mitm_cache_entries.collect_from(
            lambda: {(str(s.worker),): float(s.cache_entries) for s in self.workers}
        )

    @property
    def argv(self) -> list[str]:
        """Worker 0's command line (the others differ only in their ports)."""
        return self.workers[0].argv

    @property
    def ready(self) -> bool:
        return all(s.ready for s in self.workers)

    def not_ready(self) -> list[int]:
        return [s.worker for s in self.workers if not s.ready]

    def health(self) -> str | None:
        """The /healthz problem: which workers are not ready (None: all are)."""
        return not_ready_message(self.not_ready())

    def status(self) -> list[WorkerStatus]:
        return [WorkerStatus(s.worker, p, s.pid, s.ready, s.starts) for s, p in zip(self.workers, self.ports, strict=True)]

    def status_doc(self) -> list[dict[str, object]]:
        """The status report's ``mitmWorkers``."""
        return [
            {"worker": w.worker, "port": w.port, "pid": w.pid, "ready": w.ready, "starts": w.starts}
            for w in self.status()
        ]

    def forget(self, ips: Iterable[object] | None) -> None:
        items = None if ips is None else list(ips)  # an iterator would be used up by the first worker
        for sup in self.workers:
            sup.forget(items)

    async def wait_ready(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for sup in self.workers:
            if not await sup.wait_ready(max(0.0, deadline - loop.time())):
                return False
        return self.ready

    async def run(self) -> None:
        await asyncio.gather(*(s.run() for s in self.workers))

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.workers))
