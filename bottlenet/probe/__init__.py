"""The launch gate's probe: plan, guest script, verdict and the host-side witness.

A room of its own: it imports only ground modules (``bottlenet.errors``), Twisted and
``bottlenet.transparent`` (the link report its guest program makes), so the daemon's gate
step (``bottlenet.bottles.probe``), the real-VM test tier and an operator's ``python -m
bottlenet.probe`` all run the same code.
"""
