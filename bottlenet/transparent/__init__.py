"""Transparent egress in the agent VM: every TCP connect goes to the sidecar's CONNECT proxy.

A socket-mode agent VM has no network device; clients that honour ``HTTP_PROXY`` reach the
proxy through the bridge, the rest got nothing. This room is the guest side of issue 37: the
routes (``default dev lo src 127.0.0.1``, IPv6 ``default dev lo``) and one nf_tables ``inet``
table, both installed over netlink (``netlink.py``, ``routes.py``, ``nftables.py``: no ``ip``
or ``nft`` binary), a listener that reads each redirected connection's original destination
and opens ``CONNECT host:port`` on the named service's mounted socket (``listener.py``), and a
fake-IP resolver that lets the proxy see names (``names.py``); the bridge and the layer share
the stdin lifeline and the half-close pump (``relay.py``), and the gate's link report reads
what each link can carry (``links.py``). ``layer.py`` is the entry point
(``main(argv)``: ``install``, ``serve``, ``run``, ``remove``) that bottlenet's guest kit calls
as a subcommand; until a kit is mounted, ``script.py`` feeds the same modules to the image's
python3; ``python -m bottlenet.transparent`` (``__main__.py``) runs the layer by hand.
Standard library only, Python 3.9 or later; it imports nothing of the daemon.
"""
