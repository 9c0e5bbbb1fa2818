"""SIGINT's default disposition for a child a test stops with SIGINT.

A process started from a script's background job (or by some CI runners) inherits SIGINT as
*ignored*, and so would every child it starts: a test that stops its child with SIGINT would
then wait for nothing. Such tests start the child with ``preexec_fn=sigint_default``.
"""

from __future__ import annotations

import signal


def sigint_default() -> None:
    """In the child, before exec: SIGINT back to its default, whatever the suite inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
