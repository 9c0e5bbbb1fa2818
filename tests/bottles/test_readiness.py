"""A new sidecar's services must answer before anything uses them (issue 27 item 10).

``wait_ready`` on a Clock with a scripted probe; the create on the unit seam
(``tests/bottles/memsmolvm.py``: its probe answers unless a socket is named silent); and the real
probe, ``answers``, against real UNIX sockets on the real reactor (trial)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock, deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from bottlenet.bottles.readiness import BACKOFF_FIRST, SETTLE, TIMEOUT, answers, wait_ready
from bottlenet.errors import SidecarNotReady
from bottlenet.forward.spec import sidecar_socket_path
from tests.bottles.memsmolvm import Rig
from tests.bottles.test_rollback import assert_nothing_left, spec


def scripted(replies: dict[str | int, list[bool]], tried: list[str | int]) -> Any:
    async def probe(_reactor: Any, target: str | int) -> bool:
        tried.append(target)
        return replies[target].pop(0) if replies[target] else True

    return probe


def test_waits_with_back_off_until_every_service_answers() -> None:
    """Not ready, not ready, ready: answered after two back-off pauses; a service that
    answered is not tried again."""
    clock, tried = Clock(), []
    probe = scripted({"a": [False, False], "b": []}, tried)
    d = Deferred.fromCoroutine(wait_ready(clock, [("a", "a"), ("b", "b")], probe=probe))
    assert not d.called and tried == ["a", "b"]
    clock.advance(BACKOFF_FIRST)
    assert not d.called and tried == ["a", "b", "a"]
    clock.advance(BACKOFF_FIRST * 2)
    assert d.called and d.result is None and tried == ["a", "b", "a", "a"]


def test_a_service_that_never_answers_is_named_after_the_bound() -> None:
    """SIDECAR_NOT_READY after the timeout, naming the silent service only."""
    clock, tried = Clock(), []
    probe = scripted({"egress": [False] * 10_000, "git": []}, tried)
    d = Deferred.fromCoroutine(
        wait_ready(clock, [("egress", "egress"), ("git", "git")], probe=probe, timeout=TIMEOUT)
    )
    clock.pump([1.0] * int(TIMEOUT + 5))
    failure = d.result
    d.addErrback(lambda _: None)
    assert isinstance(failure.value, SidecarNotReady)
    assert failure.value.code == "SIDECAR_NOT_READY"
    assert "service(s) egress did not answer" in failure.value.message
    assert tried.count("git") == 1


def tries_until_done(timeout: float) -> tuple[list[float], Any]:
    """A service that never answers: the clock times of its tries (the clock jumps to each
    call it holds), and how the wait ended."""
    clock = Clock()
    at: list[float] = []

    async def probe(reactor: Any, target: str | int) -> bool:
        at.append(round(reactor.seconds(), 6))
        return False

    d = Deferred.fromCoroutine(wait_ready(clock, [("a", "a")], probe=probe, timeout=timeout))
    while not d.called:
        clock.advance(min(c.getTime() for c in clock.getDelayedCalls()) - clock.seconds())
    failure = d.result
    d.addErrback(lambda _: None)
    return at, failure


def test_the_deadline_is_the_timeout_given() -> None:
    """``timeout=0.5`` (``--sidecar-ready-timeout``): the last try at 0.5 s on the clock (its
    pause cut at the deadline), not at the default's 60 s; SIDECAR_NOT_READY says 0.5 s
    (tests-4 R06, R04)."""
    at, failure = tries_until_done(0.5)
    assert at == [0.0, 0.1, 0.3, 0.5]
    assert isinstance(failure.value, SidecarNotReady)
    assert "did not answer within 0.5 s" in failure.value.message


def test_the_pauses_double_up_to_their_cap() -> None:
    """Tries at 0, 0.1, 0.3, 0.7, 1.5, 3.1, then every BACKOFF_MAX seconds (tests-4 R05: the
    pauses never grow past it, so a late service is seen within 2 s)."""
    at, _ = tries_until_done(10)
    assert at == [0.0, 0.1, 0.3, 0.7, 1.5, 3.1, 5.1, 7.1, 9.1, 10.0]


def test_the_services_are_tried_together() -> None:
    """Two services that each answer after SETTLE are ready after one SETTLE, not two (a
    round tries them all at once)."""
    clock = Clock()
    started: list[str | int] = []

    async def probe(reactor: Any, target: str | int) -> bool:
        started.append(target)
        return await deferLater(reactor, SETTLE, lambda: True)

    d = Deferred.fromCoroutine(wait_ready(clock, [("a", "a"), ("b", "b")], probe=probe))
    assert started == ["a", "b"] and not d.called
    clock.advance(SETTLE)
    assert d.called and d.result is None


def test_a_probe_error_is_raised_as_itself() -> None:
    """A probe that raises fails the wait with its own exception (not a wrapper)."""

    async def probe(_reactor: Any, target: str | int) -> bool:
        if target == "b":
            raise ValueError("probe broke")
        return False

    d = Deferred.fromCoroutine(wait_ready(Clock(), [("a", "a"), ("b", "b")], probe=probe))
    failure = d.result
    d.addErrback(lambda _: None)
    assert isinstance(failure.value, ValueError) and str(failure.value) == "probe broke"


def test_a_create_whose_sidecar_never_answers_leaves_nothing(
    rigs: Callable[..., Rig], tmp: str
) -> None:
    """The create fails with SIDECAR_NOT_READY before the endpoints, the egress push and the
    agent: nothing is left, and no exec ever ran in the sidecar."""
    rig = rigs()
    rig.silent.add(sidecar_socket_path(rig.state_dir, "rb", "egress"))
    d = rig.start(rig.registry.create_bottle("rb", spec=spec(tmp, listen="unix")))
    for _ in range(int(TIMEOUT) + 5):
        rig.clock.advance(1.0)
        rig.settle(d)
    with pytest.raises(SidecarNotReady, match="egress"):
        rig.result(d)
    assert_nothing_left(rig)
    assert not [c for c in rig.smolvm.calls if c[0] == "exec"]


class RealProbe(TestCase):
    """``answers`` on real sockets: held is ready, dropped or absent is not."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="bnr-", dir="/tmp")
        self.addCleanup(lambda: __import__("shutil").rmtree(self.dir, True))
        #: Per listener, the connections it accepted.
        self.accepted: dict[str, list[socket.socket]] = {}

    def listener(self, name: str, drop: bool) -> str:
        path = os.path.join(self.dir, name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(8)
        held: list[socket.socket] = []
        self.accepted[path] = held

        def serve() -> None:
            while True:
                try:
                    conn, _ = s.accept()
                except OSError:
                    return
                held.append(conn)
                if drop:
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()

        def close() -> None:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
            for c in held:
                c.close()

        self.addCleanup(close)
        return path

    async def test_held_dropped_and_absent(self) -> None:
        self.assertTrue(await answers(reactor, self.listener("held", drop=False)))
        self.assertFalse(await answers(reactor, self.listener("dropped", drop=True)))
        self.assertFalse(await answers(reactor, os.path.join(self.dir, "absent")))

    async def test_a_socket_nobody_listens_on_is_not_ready(self) -> None:
        """The socket file is there but its listener is gone (the service died): the connect
        is refused, and that is no answer."""
        path = os.path.join(self.dir, "dead")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.close()  # the inode stays, nothing listens: ECONNREFUSED
        self.assertFalse(await answers(reactor, path))

    async def test_the_probes_connection_is_closed_after_it(self) -> None:
        """Once ``answers`` said yes, the service sees its connection closed (tests-4 R07:
        one left open per try, for the VM's life)."""
        path = self.listener("held", drop=False)
        self.assertTrue(await answers(reactor, path))
        conn = self.accepted[path][0]
        conn.settimeout(10)
        self.assertEqual(await deferToThread(conn.recv, 1), b"")

    async def test_a_link_or_a_file_at_the_path_is_never_connected_through(self) -> None:
        """The sidecar VMM uid's directory holds a symlink to a live socket elsewhere, or a
        plain file: not ready, and the socket behind the link never sees a connection."""
        target = self.listener("elsewhere", drop=False)
        link = os.path.join(self.dir, "egress.sock")
        os.symlink(target, link)
        self.assertFalse(await answers(reactor, link))
        plain = os.path.join(self.dir, "git.sock")
        with open(plain, "w"):
            pass
        self.assertFalse(await answers(reactor, plain))
        self.assertEqual(self.accepted[target], [])

    async def test_the_connect_goes_to_the_socket_checked(self) -> None:
        """A socket swapped for a link to another between the check and the connect (which
        the reactor makes a turn later): the connection reaches the socket that was checked."""
        checked = self.listener("egress.sock", drop=False)
        other = self.listener("other", drop=False)
        d = Deferred.fromCoroutine(answers(reactor, checked))
        os.rename(checked, checked + ".aside")
        os.symlink(other, checked)
        self.assertTrue(await d)
        self.assertEqual(len(self.accepted[checked]), 1)
        self.assertEqual(self.accepted[other], [])
