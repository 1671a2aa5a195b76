"""bench_fleet's daemon-side hooks: (e) where an in-place policy update spends its time, and the
slowdown a run can inject to check that the CI guard trips.

Both run egressd's own ``main()`` in a child the benchmark starts instead of ``.venv/bin/egressd``
(``bench_fleet.py _egressd <records.json>`` and ``bench_fleet.py _egressd_slow <spec>``): nothing
of this is an egressd option, and the product's code is not changed.

(e): every step of an action named in :data:`STEPS` is wrapped by a ``perf_counter`` pass-through
(:func:`common.wrap`); each action's record (started by ``FleetHTTP.actions``) collects the time
of every step, exclusive of the wrapped steps inside it, so the rows add up to the handler's
time. The kernel thread's part (send + acks, netlink encoding) is timed on that thread and
handed to the action that waits for it (the kernel lock serialises them). Background work an
action starts (the conntrack read and cuts of a narrowing) is kept apart: it does not delay
the answer, but competes for the same two cores and the GIL. A narrowing sequence map is
installed, as with the MITM on, so that the memory bump writes what it writes in production.
The records are written when the daemon exits (SIGTERM).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import inspect
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common as c

#: (key, label) in report order. A key's time is exclusive of the keys wrapped inside it.
STEPS: tuple[tuple[str, str], ...] = (
    ("envelope", "envelope parse (JSON, fields, fence)"),
    ("input", "binding input parse (the policy)"),
    ("claims", "claims check (ip, nft id)"),
    ("plan", "planning (plan, narrowing check, vault coverage)"),
    ("leases", "narrowing + lease bookkeeping"),
    ("build", "batch build (set contents, dyn sets)"),
    ("kernel", "kernel transaction: hand-off to the kernel thread when used, metrics"),
    ("kernel_thread", "kernel transaction: send, the kernel's work, acks"),
    ("encode", "kernel transaction: netlink encoding"),
    ("commit", "commit (registry, vault, listeners)"),
    ("mitm", "MITM memory bump (seqmap)"),
    ("metrics", "metrics"),
    ("log", "logging (structlog, one JSON line)"),
    ("gc", "garbage collection"),
    ("handler", "rest of the handler (locks, awaits, glue)"),
)
#: Work an action starts in the background (not in its answer's time).
BACKGROUND: tuple[tuple[str, str], ...] = (
    ("conntrack", "flow cut scheduling and judging (background)"),
    ("ct_read", "conntrack table read (background, a worker thread)"),
    ("ct_cut", "conntrack -D of a disallowed flow (background)"),
)
_THREAD_PARENT = {"kernel_thread": "kernel", "encode": "kernel_thread"}


def targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, key) of every wrapped step; the scaffolding test checks they exist."""
    from structlog._base import BoundLoggerBase

    from egressd import metrics
    from egressd.actionhandler import control, flows
    from egressd.actionhandler.learning import DnsLearning
    from egressd.actionhandler.shared import Claims
    from egressd.actionhandler.vaults import Credentials
    from egressd.feed import Feed
    from egressd.fleet import server
    from egressd.fleet.proxyroute import ProxyRouteAPI
    from egressd.fleetnft import backend, hostuid, steps
    from egressd.kernel import applier, netlink
    from egressd.subject.registry import Registry

    # A scheduled pass calls _cut (one read for many subjects); before issue 28 each update
    # started its own cut_disallowed (kept so that a run can measure the old code too).
    cut = "_cut" if hasattr(flows.FlowCuts, "_cut") else "cut_disallowed"
    return [(server.FleetHTTP, "actions", "handler"), (server, "parse_action", "envelope"),
            (control, "read_set_binding", "input"), (Registry, "check_claims", "claims"), (Claims, "conflict", "claims"),
            (control, "plan_set_binding", "plan"), (control, "narrows", "plan"), (Credentials, "uncovers", "plan"),
            (DnsLearning, "narrowed", "leases"), (steps.FleetSteps, "_policy_batch", "build"), (steps, "dyn_replace", "build"),
            (steps.SandboxNets, "refilled", "build"), (hostuid, "audit_membership", "build"),
            (applier.KernelTransactions, "run_batch", "kernel"), (applier._Netlink, "run", "kernel_thread"),
            (netlink, "encode_batch", "encode"), (control.ControlPlane, "_commit", "commit"), (Credentials, "bound", "commit"),
            (ProxyRouteAPI, "registered", "commit"), (Feed, "publish", "mitm"), (metrics.Counter, "inc", "metrics"),
            (metrics.Histogram, "observe", "metrics"), (metrics.Gauge, "set", "metrics"),
            (BoundLoggerBase, "_proxy_to_logger", "log"), (flows.FlowCuts, cut, "conntrack"),
            (backend, "read_flow_dests", "ct_read"), (backend, "flush_flow", "ct_cut")]  # fmt: skip


class Recorder:
    """Per action: inclusive time per key, and per key the time of the wrapped keys inside it."""

    def __init__(self) -> None:
        self.rec: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rec", default=None)
        self.stack: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("stack", default=())
        self.records: list[dict[str, Any]] = []
        # Background work (key, start, seconds): counted per window, not per action (one pass
        # of scheduled flow cuts serves many actions; its task's context is the first one's).
        self.background: list[tuple[str, float, float]] = []
        self._thread: list[tuple[str, float]] = []  # the kernel thread's timings, not yet claimed
        self._lock = threading.Lock()
        self._gc_t = 0.0
        self._background = {k for k, _ in BACKGROUND}

    def add(self, rec: dict[str, Any], key: str, dt: float, parent: str | None) -> None:
        rec[key] = rec.get(key, 0.0) + dt
        if parent is not None:
            rec["~" + parent] = rec.get("~" + parent, 0.0) + dt

    def enter(self, key: str) -> tuple[dict[str, Any] | None, str | None, contextvars.Token[tuple[str, ...]]]:
        if key in self._background:
            return None, None, self.stack.set((key,))
        if key == "handler":
            rec: dict[str, Any] | None = {"t": time.perf_counter()}
            self.rec.set(rec)  # stays set in the request's task: the middleware's bump finds it
            self.records.append(rec)  # type: ignore[arg-type]
        else:
            rec = self.rec.get()
        stack = self.stack.get()
        if stack and stack[-1] in self._background:
            rec = None  # inside background work: counted as such
        return rec, stack[-1] if stack else None, self.stack.set((*stack, key))

    def timed(self, key: str) -> Callable[..., Any]:
        """A decorator factory for one wrapped callable (sync or async)."""
        if key in _THREAD_PARENT:
            return self._on_thread(key)

        def deco(orig: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.iscoroutinefunction(orig):

                async def w_async(*a: Any, **kw: Any) -> Any:
                    rec, parent, tok = self.enter(key)
                    t = time.perf_counter()
                    try:
                        return await orig(*a, **kw)
                    finally:
                        if key in self._background:
                            self.background.append((key, t, time.perf_counter() - t))
                        elif rec is not None:
                            self.add(rec, key, time.perf_counter() - t, parent)
                            if key == "kernel":
                                self._claim(rec)
                        self.stack.reset(tok)

                return w_async

            def w_sync(*a: Any, **kw: Any) -> Any:
                rec, parent, tok = self.enter(key)
                t = time.perf_counter()
                try:
                    out = orig(*a, **kw)
                    if key == "envelope" and rec is not None:
                        rec["op"] = type(out).__name__
                    return out
                finally:
                    if key in self._background:
                        self.background.append((key, t, time.perf_counter() - t))
                    elif rec is not None:
                        self.add(rec, key, time.perf_counter() - t, parent)
                    self.stack.reset(tok)

            return w_sync

        return deco

    def _on_thread(self, key: str) -> Callable[..., Any]:
        def deco(orig: Callable[..., Any]) -> Callable[..., Any]:
            def w_thread(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return orig(*a, **kw)
                finally:
                    with self._lock:
                        self._thread.append((key, time.perf_counter() - t))

            return w_thread

        return deco

    def _claim(self, rec: dict[str, Any]) -> None:
        with self._lock:
            done, self._thread = self._thread, []
        for key, dt in done:
            self.add(rec, key, dt, _THREAD_PARENT[key])

    def on_gc(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
            return
        rec, stack = self.rec.get(), self.stack.get()
        if rec is not None and self._gc_t:
            self.add(rec, "gc", time.perf_counter() - self._gc_t, stack[-1] if stack else None)
        self._gc_t = 0.0

    def install(self) -> None:
        for owner, attr, key in targets():
            orig = getattr(owner, attr)
            wrapped = self.timed(key)(orig)
            for name in ("__middleware_version__", "__name__", "__qualname__", "__doc__"):
                if hasattr(orig, name):
                    setattr(wrapped, name, getattr(orig, name))
            setattr(owner, attr, wrapped)
        gc.callbacks.append(self.on_gc)


def instrumented_main(out_path: str) -> int:
    """egressd's main() with :class:`Recorder` installed; the records go to ``out_path`` at exit."""
    from egressd import main as emain
    from egressd.feed import Feed
    from egressd.mitm.seqmap import MitmMemory, SeqWriter

    recorder = Recorder()
    recorder.install()
    writer = SeqWriter(Path(out_path + ".seq"))  # what the MITM's memory costs a change
    memory = MitmMemory(writer)
    plain_init = Feed.__init__

    def subscribed_init(feed: Feed) -> None:  # the daemon's feed, made in run.py, has the memory
        plain_init(feed)
        feed.subscribe(memory)

    Feed.__init__ = subscribed_init  # type: ignore[method-assign, assignment]
    try:
        return emain.main([])
    finally:
        Feed.__init__ = plain_init  # type: ignore[method-assign]
        writer.close()
        records = [r for r in recorder.records if "op" in r]
        Path(out_path).write_text(json.dumps({"records": records, "background": recorder.background}))


def analyse(data: dict[str, Any], window: tuple[float, float], op: str) -> dict[str, Any]:
    """Mean ms per action of each step (exclusive), for the actions of ``op`` that started in
    ``window`` (``n`` of them); background work that started in the window, per action."""
    mine = [r for r in data["records"] if r.get("op") == op and window[0] <= r["t"] <= window[1]]
    out: dict[str, Any] = {"n": len(mine)}
    if not mine:
        return out
    for key, _ in STEPS:
        total = sum(r.get(key, 0.0) - r.get("~" + key, 0.0) for r in mine)
        out[key] = 1000.0 * total / len(mine)
    for key, _ in BACKGROUND:
        inner = {"conntrack": ("ct_read", "ct_cut")}.get(key, ())
        spans = [(k, dt) for k, t, dt in data["background"] if window[0] <= t <= window[1]]
        total = sum(dt for k, dt in spans if k == key) - sum(dt for k, dt in spans if k in inner)
        out[key] = 1000.0 * total / len(mine)
    out["handler_incl"] = 1000.0 * sum(r.get("handler", 0.0) for r in mine) / len(mine)
    out["outside"] = 1000.0 * sum(r.get("mitm", 0.0) for r in mine if "~handler" not in r) / len(mine)
    return out


# ---- the injected slowdown: checks that the CI guard trips ------------------------------------


def parse_slowdown(spec: str) -> dict[str, float]:
    """``update=2,create=2``: the factor by which the bench makes in-place policy updates
    (``update``) or a new subject's SET_BINDING at the largest size (``create``) slower, end to
    end as the client sees them. Raises ValueError."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        kind, _, factor = part.partition("=")
        if kind not in ("update", "create") or kind in out:
            raise ValueError(f"--inject-slowdown: {part!r}: want update=F and/or create=F")
        out[kind] = float(factor)
        if not 1.0 <= out[kind] <= 100.0:
            raise ValueError(f"--inject-slowdown: {part!r}: the factor must be 1..100")
    return out


def busy(seconds: float) -> None:
    """Hold the CPU (and the GIL) for ``seconds``, as extra Python work on the path would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def set_extra(control: Path, kind: str, seconds: float) -> None:
    """Tell a daemon started by :func:`slow_main` to spend ``seconds`` more on each ``kind``."""
    doc = json.loads(control.read_text()) if control.exists() else {}
    doc[kind] = seconds
    control.write_text(json.dumps(doc))


def slow_main(control: str, create_from: int) -> int:
    """egressd's main() whose SET_BINDING spends the extra seconds the bench writes to
    ``control`` (:func:`set_extra`): an in-place one (``update``), a new subject's once
    ``create_from`` subjects are registered (``create``). The bench sets them to (F - 1) times
    the median latency it measured just before, so the action then takes F times as long."""
    from egressd import main as emain
    from egressd.actionhandler.control import ControlPlane

    orig = ControlPlane.set_binding
    path = Path(control)

    async def set_binding(self: ControlPlane, action: Any) -> Any:
        in_place = self.registry.get(action.uid) is not None
        kind = "update" if in_place else ("create" if len(self.registry) >= create_from else "")
        out = await orig(self, action)
        with contextlib.suppress(OSError, ValueError):
            busy(float(json.loads(path.read_text()).get(kind, 0.0)))
        return out

    ControlPlane.set_binding = set_binding  # type: ignore[method-assign]
    c.log(
        f"egressd with an injected slowdown read from {control} (a new subject from {create_from} subjects on)"
    )
    return emain.main([])


# ---- --profile: py-spy's folded stacks of the daemon during (c), by step ---------------------

#: (step, substrings of a frame): a stack counts for the step of its deepest frame that matches
#: (a scrape of /metrics: the first step, whatever it calls).
PROFILE_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GET /metrics (the bench's scrapes between blocks, untimed)", ("metrics_handler",)),
    ("conntrack reads and cuts (a worker thread)", ("read_flow_dests (", "_scan_dests", "flow_dests_from", "FlowCuts.")),
    ("kernel transaction (encoding, send, acks)", ("NfTablesSocket.run", "_Netlink.run", "run_batch_sync")),
    ("binding input parse", ("read_set_binding", "parse_binding_input")),
    ("envelope parse", ("parse_action",)),
    ("claims and planning",
     ("check_claims", "plan_set_binding", "Claims.conflict", "Credentials.uncovers", "narrows (egressd/actionhandler")),
    ("batch build, set contents, narrowing checks",
     ("_policy_batch", "policy_swap", "contents_swap", "dyn_replace", "policy_contents", "static_contents",
      "refuses_more", "_takes_away", "DnsLearning.narrowed", "names_narrow")),
    ("MITM memory bump", ("Feed.publish", "MitmMemory.", "SeqWriter.bump")),
    ("logging (structlog)", ("structlog",)),
    ("metrics (counting)", ("egressd/metrics.py", "prometheus_client")),
    ("HTTP (aiohttp)", ("aiohttp",)),
)  # fmt: skip
OTHER = "the rest (event loop, locks, glue, thread hand-offs)"


def _step_of(stack: str) -> str:
    if "metrics_handler" in stack:  # all of a scrape, whatever it calls
        return PROFILE_STEPS[0][0]
    for frame in reversed(stack.split(";")):
        for step, keys in PROFILE_STEPS:
            if any(k in frame for k in keys):
                return step
    return OTHER


def profile_summary(folded: str) -> tuple[int, dict[str, int]]:
    """(samples, samples per step) of py-spy's raw (folded) output."""
    total, per = 0, dict.fromkeys([*(s for s, _ in PROFILE_STEPS), OTHER], 0)
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        per[_step_of(stack)] += int(count)
    return total, per
