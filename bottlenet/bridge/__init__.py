"""bottlenet's own in-guest bridge: guest TCP ``127.0.0.1:<port>`` to the mounted UNIX socket.

A socket-mode agent VM has no network device; its services are host UNIX sockets mounted at
``/run/bottle/<service>.sock``, while the agents people run speak TCP to ``{host}:{port}``.
This room holds the program the guest kit runs, or the daemon feeds the guest's ``python3``
where there is no kit (``guest.py``, standard library only), the short program that proves
each port reaches the host (``reach.py``), and how both are rendered into the ``/bin/sh -s``
script (``script.py``). Like the probe, it imports nothing of the daemon:
``python -m bottlenet.bridge script PORT=PATH ...`` (``__main__.py``) prints the exact script
by hand.
"""
