"""Contract: which lock each machine call takes, through the REAL smolvm CLI and the fake.

``strace -f`` of the real CLIs (docs/smolvm.md, "Locks") shows ``machine start`` holding the
machine's ``vms/<id>/vm.lock`` (taken without waiting) and ``stop``/``delete`` its
``vms/.<name>.fork-operation.lock`` for the whole call, and nothing that spans machines but
the SQLite state's short transactions and the uid registry's ``.allocation.lock``. Here both
binaries run with machine ``a``'s two locks held by the test, as a start and a stop of ``a``
in progress hold them: ``a``'s start is refused as already starting, and machine ``b``
starts (to the KVM error of these hosts), stops and is deleted meanwhile. The fake models
the same locks, so bottlenet's concurrent sidecar and agent boots are tested as they run.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.fakes.smolvm_impl import ALREADY_STARTING
from tests.vmctl.test_contract import CLI, clis, kvm_usable
from tests.vmctl.wheeltemplates import real_templates
from vmctl.errors import KvmUnavailable, SmolvmFailed

__all__ = ["clis", "real_templates"]  # the fixtures


@contextmanager
def flocked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def machine_locks(cli: CLI, name: str) -> tuple[str, str]:
    """The start lock and the stop lock of machine ``name`` (its VM dir made if need be)."""
    vm_dir = cli.machine("data-dir", "--name", name).r.stdout.decode().strip()
    os.makedirs(vm_dir, exist_ok=True)
    return os.path.join(vm_dir, "vm.lock"), os.path.join(
        os.path.dirname(vm_dir), f".{name}.fork-operation.lock"
    )


@pytest.mark.usefixtures("real_templates")
@pytest.mark.skipif(kvm_usable(), reason="this host says its KVM boots smolvm VMs")
def test_one_machines_locks_leave_another_machine_alone(clis: dict[str, CLI]) -> None:
    """With ``a``'s start lock held, ``a``'s start is refused with the same words and ``b``
    starts (to the KVM error); with ``a``'s stop lock held, ``b`` stops and is deleted: in
    both binaries. (1.37.3 also takes the stop lock at start, waiting: so the two are held
    one at a time here.)"""
    clis["fake"].fake_faults("kvm-root" if os.geteuid() == 0 else "kvm")
    for kind, cli in clis.items():
        for name in ("a", "b"):
            assert cli.machine("create", "--name", name).ok, kind
        start_lock, stop_lock = machine_locks(cli, "a")
        with flocked(start_lock):
            refused = cli.machine("start", "--name", "a")
            assert isinstance(refused.error, SmolvmFailed), (kind, refused.r.stderr)
            assert ALREADY_STARTING in refused.error.message, (kind, refused.error.message)
            other = cli.machine("start", "--name", "b", timeout=300)
            assert isinstance(other.error, KvmUnavailable), (kind, other.r.stderr[-300:])
        with flocked(stop_lock):
            assert cli.machine("stop", "--name", "b").ok, kind
            assert cli.machine("delete", "--name", "b", "-f").ok, kind
        assert [m["name"] for m in cli.machine("ls", "--json").json()] == ["a"], kind
