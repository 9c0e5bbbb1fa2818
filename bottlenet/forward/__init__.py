"""The data plane: agent endpoint listeners and the byte-transparent relays behind them.

- :mod:`~bottlenet.forward.spec`: endpoint and target values; the binding invariants.
- :mod:`~bottlenet.forward.aliases`: one loopback alias per bottle.
- :mod:`~bottlenet.forward.table`: every listener, its relays, counters and caps.
- :mod:`~bottlenet.forward.listen`: listening ports whose accept loop survives EMFILE.
- :mod:`~bottlenet.forward.connect`: a cheap cancellable client endpoint.
- :mod:`~bottlenet.forward.relay`: the portable relay (backpressure, half-close, reset).
- :mod:`~bottlenet.forward.splice`: the Linux ``splice(2)`` engine.
- :mod:`~bottlenet.forward.fastreactor`: an epoll reactor without per-event log context.
- :mod:`~bottlenet.forward.budget`: per-bottle and global connection budgets, the idle sweep.
- :mod:`~bottlenet.forward.targets`: a target is never the daemon's own socket nor outside
  the bottle's target directory.
- :mod:`~bottlenet.forward.ratelimit`: rate-limited log lines, shared by every plane.
- :mod:`~bottlenet.forward.capabilities`: the optional engine, port and reactor capabilities.

The table alone, for benchmarks, is ``benchmarks/standalone.py`` (not shipped).

The rule of this room: the data plane knows no VMs, no AMP and no bottles' lifecycle. It
imports only the ground floor (:mod:`bottlenet.errors`, :mod:`bottlenet.paths`).
"""
