"""The node's policies about its bottles: a room beside the control plane, above the bottles.

- :mod:`~bottlenet.node.drain`: the drain gate (DRAINING, its record in the state store, the
  wait for empty), the table's admission.
- :mod:`~bottlenet.node.lease`: the lease policy (grace, the monotonic clock) and each
  bottle's lease timer, which reaps a bottle whose lease and grace ran out.
- :mod:`~bottlenet.node.info`: this host as a node of a fleet (``NodeInfo``'s report,
  ``--label``), what the creates told of KVM, and the node's controls.
- :mod:`~bottlenet.node.pools`: the warm pools, filled, trimmed and replaced, kept in the
  node's record.

The rule of this room: the node's policies hear the bottles through their outputs
(:mod:`bottlenet.bottles.policy`, injected into the table), never by subscribing to the event
bus; they use the bottles wing, the data plane's budget and the ground floor, drive no VM
and know no AMP, CLI or daemon plumbing.
"""
