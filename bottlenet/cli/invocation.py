"""One ``bottlenetctl`` run as a value: parsed once in ``main``, read (never written) after.

The subcommand's parser names what runs (``set_defaults(run=...)``); ``main`` adds what every
run shares: where the daemon is, TLS, ``--timeout``, ``--json`` and the ``--spec`` file's text.
A ``NamedTuple``, not attrs: ``status`` and ``ping`` import no attrs (their start is measured).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO, TypeVar

from bottlenet.cli.output import EXIT_DAEMON, EXIT_OK, report_control_error, write_error
from bottlenet.control.calls import DEFAULT_TIMEOUT, VM_TIMEOUT, Call, every_item
from bottlenet.control.clienterrors import ControlConnectionError
from bottlenet.errors import BottlenetError

if TYPE_CHECKING:
    from bottlenet.control.address import TLSCredentials
    from bottlenet.control.blocking import BlockingControlClient
    from bottlenet.control.results import Page

T = TypeVar("T")


class Invocation(NamedTuple):
    """What to run and how to reach the daemon (``--timeout`` None: each call's own pace)."""

    #: What the subcommand's parser named: ``run(invocation, out, err)``, the exit status.
    run: Run
    #: The subcommand's own arguments, as argparse read them.
    options: argparse.Namespace
    #: The control socket's path, or the ``tls:HOST:PORT`` address.
    path: str
    tls: TLSCredentials | None
    timeout: float | None
    json: bool
    #: ``--spec FILE.toml`` as JSON text (None: no ``--spec``).
    spec_json: str | None
    #: ``bottle exec``: the words after ``--``.
    after_dashes: tuple[str, ...]
    #: The command line's words (before ``--``), to show an error about one of them as typed.
    words: tuple[str, ...] = ()
    #: ``$BOTTLENET_CAPABILITY``: a scoped peer's capability, given with each call about
    #: bottles (never a flag: a command line is readable by every local user).
    capability: str | None = None

    @property
    def call_timeout(self) -> float:
        """A quick call's limit: ``--timeout``, else the default."""
        return DEFAULT_TIMEOUT if self.timeout is None else self.timeout

    @property
    def vm_timeout(self) -> float:
        """The limit of a call that waits on VMs: ``--timeout``, else the VM timeout."""
        return VM_TIMEOUT if self.timeout is None else self.timeout

    def blocking_client(self) -> BlockingControlClient:
        """The AMP client (TLS too), with this run's limits (imported only when a run needs it)."""
        from bottlenet.control.blocking import BlockingControlClient

        return BlockingControlClient(
            self.path,
            timeout=self.call_timeout,
            vm_timeout=self.vm_timeout,
            tls=self.tls,
            capability=self.capability,
        )

    def client(self, *, light: bool) -> Any:
        """The light client (no Twisted) for ``light`` commands on a UNIX socket, else the
        blocking one; both run ``call(calls.x(...))``."""
        if light and self.tls is None:
            from bottlenet.control.lightclient import LightControlClient

            return LightControlClient(
                self.path,
                self.call_timeout,
                vm_timeout=self.vm_timeout,
                capability=self.capability,
            )
        return self.blocking_client()


#: A subcommand's runner: the exit status of ``bottlenetctl`` for one invocation.
Run = Callable[[Invocation, TextIO, TextIO], int]
#: A command that makes its calls on one client (either client: they share ``call``).
Handler = Callable[[Any, Invocation, TextIO], None]


class ClientCommand(NamedTuple):
    """The runner of a command that makes its calls on one client: ``handler(client, inv,
    out)``; ``light``: the light client may run it (its calls are Hello, Ping, ListBottles
    and NodeInfo only). A value, so two parsers built alike compare equal."""

    handler: Handler
    light: bool = False

    def __call__(self, inv: Invocation, out: TextIO, err: TextIO) -> int:
        try:
            with inv.client(light=self.light) as client:
                self.handler(client, inv, out)
        except (ControlConnectionError, BottlenetError) as e:
            return report_control_error(e, inv.path, err, as_json=inv.json, typed=inv.words)
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # never a traceback for a person at a terminal
            message = f"bottlenetctl failed: {type(e).__name__}"
            write_error(err, "INTERNAL", message, as_json=inv.json)
            return EXIT_DAEMON
        return EXIT_OK


def every(client: Any, page: Callable[[int], Call[Page[T]]]) -> Iterator[T]:
    """Every item of a paged listing through ``client.call``: ``page(offset)`` is one page."""
    return every_item(lambda offset: client.call(page(offset)))
