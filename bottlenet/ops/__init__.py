"""Daemon plumbing: what every long-running service needs, whatever it serves.

- :mod:`~bottlenet.ops.logs`: log formats (text, JSON), escaping, rate-limited and aggregated lines.
- :mod:`~bottlenet.ops.metrics`: the Prometheus ``/metrics`` site and the daemon's recorders.
- :mod:`~bottlenet.ops.metricsservice`: the ``/metrics`` listener behind its connection cap.
- :mod:`~bottlenet.ops.sdnotify`: systemd readiness (``READY=1``, ``STOPPING=1``).
- :mod:`~bottlenet.ops.rlimits`: raising ``RLIMIT_NOFILE`` to what the reactor can use.
- :mod:`~bottlenet.ops.fatal`: the one way the daemon stops on an error it must not run on with.
- :mod:`~bottlenet.ops.listening`: listen on an endpoint, or the daemon does not run.

The rule of this room: ops knows how to run a daemon, not what bottlenet does. It imports the
ground floor (:mod:`bottlenet.errors`, :mod:`bottlenet.paths`) and the data plane's value
parsers (:mod:`bottlenet.forward.spec`) only; the records it reports on are named under
``TYPE_CHECKING``.
"""
