"""The launch gate's probe: plan, guest script, verdict and the host-side witness.

A room of its own: it imports only ground modules (``bottlenet.errors``), Twisted and
``bottlenet.transparent`` (the link report its guest program makes), so the daemon's gate
step (``bottlenet.bottles.probe``), the real-VM test tier and an operator's ``python -m
bottlenet.probe`` all run the same code.

- :mod:`~bottlenet.probe.plan`: one frozen, validated plan of what the gate checks.
- :mod:`~bottlenet.probe.guest`: the checks, run in the guest (by the kit or its python3).
- :mod:`~bottlenet.probe.script`: the exact POSIX sh script for a plan.
- :mod:`~bottlenet.probe.judge`: the verdict on a transcript plus what the host saw.
- :mod:`~bottlenet.probe.witness`: the host side of the own-endpoint check.
- :mod:`~bottlenet.probe.__main__`: ``python -m bottlenet.probe script|judge``, by hand.
"""
