"""Unit tests: no root, no namespaces, no network beyond loopback.

The layout mirrors the source tree, so the tests of a module are found where the module is:
``tests/unit/<package>/`` tests ``egressd/<package>/`` (``tests/unit/dnsproxy/`` tests
``egressd/dnsproxy/``), files directly in ``tests/unit/`` test the top-level modules and the
package as a whole (``config``, ``hygiene``, the architecture rules), ``tests/unit/scripts/``
tests ``scripts/``. ``tests/unit/fuzz/`` is its own concern: property-based campaigns over every
parser, whatever package holds it. A test that drives a module through another one (the fleet
HTTP app over the control plane, say) lives with the module whose behaviour it asserts.

Every test that needs a kernel takes the one fake in :mod:`tests.unit.fakekernel`.
"""
