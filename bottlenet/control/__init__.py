"""The control plane: the AMP contract, who may speak it, and the clients that do.

- :mod:`~bottlenet.control.commands`: the AMP commands (protocol version 1) and error codes.
- :mod:`~bottlenet.control.framing` / :mod:`~bottlenet.control.protocol`: the bounded box
  parser and the hardened AMP protocol.
- :mod:`~bottlenet.control.peercred`: who is on the other end of a UNIX connection.
- :mod:`~bottlenet.control.endpoints`: the private UNIX socket, systemd adoption, TLS.
- :mod:`~bottlenet.control.context`: what both listeners share, and how each admits a peer
  (:mod:`~bottlenet.control.admission`: a TLS handshake's deadline and caps).
- :mod:`~bottlenet.control.server`: the peer check and the responders (each argument parsed
  once, into the values the bottles wing takes).
- :mod:`~bottlenet.control.scope`, :mod:`~bottlenet.control.identity`: a scoped peer's view of
  the bottles of the capability a call presents, and its identity.
- :mod:`~bottlenet.control.smolvmnote`: smolvm's packed-assets note, dropped from an exec's
  output.
- :mod:`~bottlenet.control.backend`: what the server needs from the bottles wing (typed).
- :mod:`~bottlenet.control.records`: the wire records and the one conversion from a bottle
  or a forward to its record.
- :mod:`~bottlenet.control.results`, :mod:`~bottlenet.control.codec`: typed results,
  reactor-free boxes.
- :mod:`~bottlenet.control.execbroker`: the daemon's half of an exec session (smolvm child
  on one side, the switched connection on the other).
- :mod:`~bottlenet.control.events`: bottle events pushed to watchers, bounded per watcher.
- :mod:`~bottlenet.control.calls`: each call declared once (command, arguments, pace, answer
  conversion; no AMP), run by every client.
- :mod:`~bottlenet.control.client` / :mod:`~bottlenet.control.blocking`: the async and the
  blocking client (the client side: imports no daemon module), with
  :mod:`~bottlenet.control.address` (``PATH`` or ``tls:HOST:PORT`` and the client
  certificate), :mod:`~bottlenet.control.stream` (the exec frames),
  :mod:`~bottlenet.control.terminal` (raw mode and SIGWINCH for an exec),
  :mod:`~bottlenet.control.execsession` (a running exec on the client side),
  :mod:`~bottlenet.control.lightclient` (Hello, Ping, ListBottles without Twisted),
  :mod:`~bottlenet.control.clienterrors` and :mod:`~bottlenet.control.specbuilder` (a typed
  bottle spec).

The rule of this room: control translates AMP into calls on the bottles wing and back. It
never drives smolvm itself (no :mod:`vmctl` import): VM work goes through
:mod:`bottlenet.bottles`.
"""
