"""Contract: where smolvm keeps a machine's own files, through the REAL smolvm CLI and the fake.

vmctl reserves a machine's per-VM uid in the machine's directory (``machine data-dir``). It
asks smolvm once per daemon and, once the answer matched :func:`vmctl.smolvm.vm_dir_of`,
computes it for later machines (issue 38: one CLI call less per machine). Here every tested
real CLI and the fake playing it print exactly that path, for the names bottlenet gives.
"""

from __future__ import annotations

from tests.vmctl.test_contract import CLI, clis
from vmctl.smolvm import vm_dir_of

__all__ = ["clis"]  # the fixture

NAMES = ("a", "bn-b1-agent", "bn-b1-sidecar", "bn_0123456789abcdef0123-agent")


def test_data_dir_is_the_names_digest_under_the_state_dir(clis: dict[str, CLI]) -> None:
    """``machine data-dir`` prints ``<state dir>/.cache/smolvm/vms/<sha256(name)[:16]>``."""
    for kind, cli in clis.items():
        for name in NAMES:
            assert cli.machine("create", "--name", name).ok, (kind, name)
            printed = cli.machine("data-dir", "--name", name).r.stdout.decode().strip()
            assert printed == vm_dir_of(cli.state_dir, name), (kind, name, printed)
