"""``bottlenetctl``: the console client.

- :mod:`~bottlenet.cli.main`: the argument parser, the bottle/forward/stats commands, exit codes.
- :mod:`~bottlenet.cli.top`: ``bottlenetctl top``, a live view of bottles and counters.
- :mod:`~bottlenet.cli.down`: ``bottlenetctl down``, every bottle destroyed in order.
- :mod:`~bottlenet.cli.attach`: ``bottle exec``, ``bottle shell``, ``bottle logs``.
- :mod:`~bottlenet.cli.node`, :mod:`~bottlenet.cli.pool`: ``node info|drain|undrain``,
  ``pool ensure|ls|rm``.
- :mod:`~bottlenet.cli.selftest`: ``bottlenetctl selftest``, VM bottles checked on a new host.
- :mod:`~bottlenet.cli.invocation`: one run as a value, parsed once.
- :mod:`~bottlenet.cli.output`: exit codes, error reporting, the one table renderer.
- :mod:`~bottlenet.cli.__main__`: ``python -m bottlenet.cli``.

The rule of this room: the console client talks to the daemon only over the control socket.
It imports the client side of :mod:`bottlenet.control` (blocking client, records, error
codes) and :mod:`bottlenet.paths`, never a daemon module.
"""
