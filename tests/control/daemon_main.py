"""A real daemon process for end-to-end tests: the tap's service tree plus a ControlService.

Usage: python -m tests.control.daemon_main STATE_DIR CONTROL [SYSTEMD_FD]
With SYSTEMD_FD the fd is moved to 3 and LISTEN_* are set, as systemd would.
STATE_DIR "FAKE" serves the in-memory fake backend instead of the real service tree.
This is the wiring the daemon's tap is expected to do.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    state_dir, control = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        fd = int(sys.argv[3])
        if fd != 3:
            os.dup2(fd, 3)
            os.close(fd)
        os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="control")

    from twisted.internet import reactor
    from twisted.logger import globalLogBeginner, textFileLogObserver

    globalLogBeginner.beginLoggingTo([textFileLogObserver(sys.stdout)])

    from twisted.application.service import MultiService

    from bottlenet import __version__
    from bottlenet.control.listen import ControlService
    from bottlenet.control.peercred import default_allowed_uids
    from bottlenet.control.server import ControlServerFactory

    root: MultiService
    if state_dir == "FAKE":
        from tests.control.fakes import FakeBackend

        root = MultiService()
        backend, target_root = FakeBackend(), None
    else:
        from bottlenet.tap import Options, build_service

        options = Options()
        options.parseOptions(["--state-dir", state_dir])
        tree = build_service(options, reactor)
        root, backend, target_root = tree, tree.registry, tree.state_dir
    factory = ControlServerFactory(
        backend,
        server_version=__version__,
        smolvm_version=None,
        allowed_uids=default_allowed_uids(),
        unix_target_root=target_root,
    )
    ControlService(reactor, control, factory).setServiceParent(root)
    root.startService()
    reactor.addSystemEventTrigger("before", "shutdown", root.stopService)
    reactor.run()


if __name__ == "__main__":
    main()
