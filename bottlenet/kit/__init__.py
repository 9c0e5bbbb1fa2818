"""bottlenet's guest kit: the program bottlenet runs in every guest, built on this host.

``guest.py`` (the ``bottlenet-kit`` program, run inside a guest) and ``parent.py`` (the
workload's parent) are standard-library programs; ``program.py`` is the kit's command line
as a guest runs it; ``build.py`` builds and caches the kit under the state directory;
``keeper.py`` is the daemon's side: the kit built off the reactor thread at start, checked
before each mount. The room's rule: the ground floor, ``probe``, ``bridge`` and
``vmctl.sessionend`` (whose programs it packs); nothing of ``bottles`` or above.
"""
