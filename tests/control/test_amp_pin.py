"""Pin the private AMP names ``control/protocol.py`` relies on.

If Twisted is upgraded, ``AMP_VERIFIED_TWISTED`` no longer matches and these tests fail loudly,
so someone re-checks ``twisted/protocols/amp.py`` (``CommandLocator._wrapWithSerialization``,
``BoxDispatcher._outstandingRequests`` and ``_safeEmit``, ``AMP.makeConnection``'s
``_transportPeer``/``_transportHost``) and then adds the new version to the set.
"""

from __future__ import annotations

import inspect
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import LogEvent
from twisted.protocols import amp

import twisted
from bottlenet.control import protocol
from bottlenet.control.protocol import HardenedAMP, SafeCommandLocator

from .fakes import make_factory


def test_twisted_version_is_verified_for_the_private_amp_names() -> None:
    """The installed Twisted is one the private AMP names were checked against."""
    assert twisted.__version__ in protocol.AMP_VERIFIED_TWISTED, (
        f"Twisted {twisted.__version__} is not verified for HardenedAMP: re-check the private"
        " AMP names it uses, then add the version to AMP_VERIFIED_TWISTED"
    )
    assert protocol.amp_private_names_verified() is True


def test_unverified_version_is_reported(monkeypatch: Any) -> None:
    """Another Twisted version is not verified, whatever names it has."""
    monkeypatch.setattr(twisted, "__version__", "99.0.0")
    assert protocol.amp_private_names_verified() is False


def test_a_missing_private_name_is_reported(monkeypatch: Any) -> None:
    """A verified version that lost one of the names is not verified either."""
    monkeypatch.delattr(amp.BoxDispatcher, "_safeEmit")
    assert protocol.amp_private_names_verified() is False


def test_responders_are_still_wrapped_by_wrap_with_serialization() -> None:
    """Stock lookup still goes through ``_wrapWithSerialization``: our override is the one
    place where every responder's arguments are parsed and its errors made value-free."""
    src = inspect.getsource(amp.CommandLocator.locateResponder)
    assert "return self._wrapWithSerialization(responderMethod, commandClass)" in src
    assert "_wrapWithSerialization" in vars(SafeCommandLocator)


def test_outstanding_requests_still_maps_tags_to_waiting_calls() -> None:
    """``_outstandingRequests`` is still the tag -> Deferred map answers are matched against."""
    assert amp.BoxDispatcher._outstandingRequests is None  # until boxes are received
    assert "self._outstandingRequests = {}" in inspect.getsource(amp.BoxDispatcher.__init__)
    assert "self._outstandingRequests.pop(box[ANSWER])" in inspect.getsource(
        amp.BoxDispatcher._answerReceived
    )
    assert "self._outstandingRequests.pop(box[ERROR])" in inspect.getsource(
        amp.BoxDispatcher._errorReceived
    )


def test_safe_emit_still_sends_a_box_ignoring_a_lost_connection() -> None:
    """``_safeEmit`` still writes the box to the box sender and swallows only a lost
    connection or a protocol switch."""
    src = inspect.getsource(amp.BoxDispatcher._safeEmit)
    assert "aBox._sendTo(self.boxSender)" in src
    assert "except (ProtocolSwitched, ConnectionLost):" in src


def test_make_connection_still_only_adds_the_transport_names_and_a_log_line() -> None:
    """Our ``makeConnection`` skips ``AMP.makeConnection`` (its INFO line per connection) but
    sets what it sets; stock AMP still reads them only for its own log lines."""
    src = inspect.getsource(amp.AMP.makeConnection)
    assert "self._transportPeer = transport.getPeer()" in src
    assert "self._transportHost = transport.getHost()" in src
    assert "BinaryBoxProtocol.makeConnection(self, transport)" in src
    module = inspect.getsource(amp)
    assert module.count("self._transportPeer") == 3  # set once, read by the two log lines
    assert "amp.BinaryBoxProtocol.makeConnection(self, transport)" in inspect.getsource(
        HardenedAMP.makeConnection
    )


def test_the_daemon_warns_at_start_on_an_unverified_twisted(
    monkeypatch: Any, logs: list[LogEvent]
) -> None:
    """The control factory says so at start when the private AMP names are not verified."""
    factory = make_factory(clock=Clock())
    factory.doStart()
    factory.doStop()
    assert not [e for e in logs if "AMP_VERIFIED_TWISTED" in str(e.get("log_format"))]
    monkeypatch.setattr(twisted, "__version__", "99.0.0")
    factory.doStart()
    factory.doStop()
    (warning,) = [e for e in logs if "AMP_VERIFIED_TWISTED" in str(e.get("log_format"))]
    assert warning["version"] == "99.0.0"
