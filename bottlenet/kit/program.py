"""The kit's program as a guest command: its loader named directly, never a shell or PATH.

A value, no I/O: the bottles room builds every guest command of bottlenet's from it.
"""

from __future__ import annotations

from attrs import frozen

#: Where the kit is mounted (read-only) in every agent VM and in the sidecar.
GUEST_DIR = "/run/bottlenet-kit"
#: The kit's layout, relative to its root.
LIB = "lib"
PYTHON = "bin/python3"
MAIN = "app/main.pyc"


@frozen
class KitProgram:
    """``bottlenet-kit`` at ``root``: its own loader runs its own interpreter on its own
    libraries (``--inhibit-cache``: not the guest's ``ld.so.cache``), isolated from the
    guest's environment (``-I``), in UTF-8 mode whatever the guest's locale (``-X utf8``)."""

    #: The loader's path relative to the root (``lib/ld-linux-x86-64.so.2`` on x86_64).
    loader: str
    root: str = GUEST_DIR

    def argv(self, *words: str) -> list[str]:
        r = self.root
        return [
            f"{r}/{self.loader}",
            "--library-path",
            f"{r}/{LIB}",
            "--inhibit-cache",
            f"{r}/{PYTHON}",
            "-I",
            "-S",
            "-B",
            "-X",
            "utf8",
            f"{r}/{MAIN}",
            *words,
        ]

    def at(self, root: str) -> KitProgram:
        """The same kit at another root (the host's copy, for the self-test and tests)."""
        return KitProgram(self.loader, root)


@frozen
class KitRef:
    """The kit a bottle's VMs have mounted (kept on its record): its digest, which the gate
    checks in the guest, and its loader, which names its program."""

    digest: str
    loader: str

    @property
    def program(self) -> KitProgram:
        return KitProgram(self.loader)

    def argv(self, *words: str) -> list[str]:
        """The kit's program with ``words``, at the guest's fixed path."""
        return self.program.argv(*words)

    def session(self) -> list[str]:
        """The session wrapper's argv (the command to wrap follows)."""
        return self.argv("session")


def kit_session(kit: KitRef | None) -> list[str]:
    """The session wrapper vmctl puts before an attached command (empty: the image's)."""
    return [] if kit is None else kit.session()
