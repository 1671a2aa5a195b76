"""The fleet's kernel side, as the subject engine takes it: :class:`egressd.engine.plansteps.PlanKernel`.

Built by the composition root (egressd/fleet/run.py; the tests' fixtures) from the table's
knobs and the kernel's transactions, and handed to
:class:`egressd.actionhandler.control.ControlPlane`: each plan step's netlink objects
(fleetnft/steps.py), the always-rules reload's contents swap (fleetnft/always.py), the
kernel's own view for operators (fleetnft/kernelview.py) and the subject engine's ruleset
backend (fleetnft/backend.py).
"""

from __future__ import annotations

from egressd.fleetnft.always import FleetContentsSwap
from egressd.fleetnft.backend import FleetBackend
from egressd.fleetnft.kernelview import FleetKernelView
from egressd.fleetnft.steps import FleetSteps
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import Transactions


class FleetPlanKernel:
    def __init__(self, table: TableConfig, tx: Transactions, *, backend: FleetBackend | None = None) -> None:
        self.table = table
        self.tx = tx
        # The subject engine's ruleset backend (leases, flow cuts) over the same table.
        self.backend = backend if backend is not None else FleetBackend(table, tx)
        self.steps = FleetSteps(table, tx)
        self.reader = FleetKernelView(table, tx)

    def contents_swap(self) -> FleetContentsSwap:
        return FleetContentsSwap(self.table, self.tx)
