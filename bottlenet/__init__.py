"""bottlenet: the host daemon that runs, wires and isolates bottles (agent VM + sidecar VM).

The ground floor and the composition root:

- :mod:`~bottlenet.errors`: typed errors with their wire codes.
- :mod:`~bottlenet.paths`: where the daemon keeps things (state dir, control socket path,
  private directories).
- :mod:`~bottlenet.fields`: the one typed-field reader (state file, spec, config, wire
  records).
- :mod:`~bottlenet.settings`: the ``twist``/``twistd`` options, checked into one frozen
  ``DaemonSettings`` (:func:`~bottlenet.settings.settings_from`).
- :mod:`~bottlenet.tap`: the one place that composes the service tree (the disk step, then
  :func:`~bottlenet.tap.compose`).

The rooms: :mod:`bottlenet.forward` (data plane), :mod:`bottlenet.bottles` (bottle model,
lifecycle, recovery), :mod:`bottlenet.control` (AMP contract, responder, clients),
:mod:`bottlenet.ops` (daemon plumbing), :mod:`bottlenet.cli` (``bottlenetctl``); the smolvm
driver is the top-level package :mod:`vmctl`. ``docs/architecture.md`` shows the doors.
"""

from __future__ import annotations

__version__ = "0.1.0"
