"""The bottles wing: what a bottle is, how one is made, kept, checked and taken apart.

- :mod:`~bottlenet.bottles.spec`: the bottle spec a launcher sends, validated field by field;
  :mod:`~bottlenet.bottles.specrules`: its pure value rules (a leaf launchers import too).
- :mod:`~bottlenet.bottles.config`: the daemon's TOML file of forward-only bottles;
  :mod:`~bottlenet.bottles.services`: ``ConfigBottles``, which binds them at start.
- :mod:`~bottlenet.bottles.model`: the one ``Bottle`` value (forward-only = no VMs) and its
  state-file record.
- :mod:`~bottlenet.bottles.store`: the durable state file (atomic, 0600).
- :mod:`~bottlenet.bottles.registry`: the table of the bottles the daemon knows; one operation
  per bottle, each delegated to the bottle's owner.
- :mod:`~bottlenet.bottles.bottle`: one owner per bottle (forward-only, or with VMs), over
  :mod:`~bottlenet.bottles.core` (its value, its lease, the revocation not yet durable; the
  writes and events its transitions make); :mod:`~bottlenet.bottles.vmmachine`: a VM bottle's
  machine, whose states carry their data (the ``Creation``, the ``Running``, the
  ``Teardown``); :mod:`~bottlenet.bottles.states`: the phases as the table tells them and the
  registry's gate; :mod:`~bottlenet.bottles.policy`: what the node's policies hear.
- :mod:`~bottlenet.bottles.execs`, :mod:`~bottlenet.bottles.sessions`: a launcher's sessions,
  each bottle's own count capped.
- :mod:`~bottlenet.bottles.creation`: a VM create's steps with their undos.
- :mod:`~bottlenet.bottles.host`: the frozen ``VMHost`` of the parts a VM bottle's steps use
  (built once in ``tap.py``), and its own steps: uids, endpoints, verify, egress, teardown.
- :mod:`~bottlenet.bottles.volumes`: a create's volumes resolved once without links and
  checked for whoever asks; :mod:`~bottlenet.bottles.volumeaccess`: the agent VMM uid's ACL
  grant on them and its revoke; :mod:`~bottlenet.bottles.volumegrants`: the record of every
  grant not yet taken back; :mod:`~bottlenet.bottles.posixacl`: a directory's ACL through a
  descriptor, and the kernel's rule of who it lets in.
- :mod:`~bottlenet.bottles.vmerrors`: vmctl's errors as the control plane's.
- :mod:`~bottlenet.bottles.recovery`: reconcile the state file with reality at start (whether
  a kept VM bottle lives on: ``check_alive``, ``rebind``).
- :mod:`~bottlenet.bottles.isolation`: which isolation mode, which mechanism, which VM flags.
- :mod:`~bottlenet.bottles.probe`: the launch gate step (markers, witness, exec, verdict) around
  :mod:`bottlenet.probe`.
- :mod:`~bottlenet.bottles.egress`: the sidecar's egress allow-list, pushed and reloaded.
- :mod:`~bottlenet.bottles.owncommand`: one of bottlenet's own commands in a guest, as its
  root, under the kit's session wrapper (the gate, the reach proof, the policy's write).
- :mod:`~bottlenet.bottles.agentenv`: the agent's stamped environment.
- :mod:`~bottlenet.bottles.watch`: notice a VM process exit without polling smolvm.
- :mod:`~bottlenet.bottles.attach`: a launcher's command in the agent VM (``exec -i [-t]``).
- :mod:`~bottlenet.bottles.workload`: the workload's start after the gate, its wrapper, its exit
  waiter, its log.
- :mod:`~bottlenet.bottles.events`: bottle events as they happen (created ... destroyed);
  :mod:`~bottlenet.bottles.egresswatch`: the sidecar's egress-floor denials among them.
- :mod:`~bottlenet.bottles.bridge`: the in-guest bridge, started, proven, watched, restarted;
  :mod:`~bottlenet.bottles.egresslayer`: the transparent egress layer, kept the same way.
- :mod:`~bottlenet.bottles.readiness`: each sidecar service answers before it is used;
  :mod:`~bottlenet.bottles.vmmaccess`: which VMM uid may reach which socket;
  :mod:`~bottlenet.bottles.unseen`: why a connection never reached the host;
  :mod:`~bottlenet.bottles.vmloss`: whether a session ended because its VM did.
- :mod:`~bottlenet.bottles.tenancy`: a bottle's owner, scoped creator and lease;
  :mod:`~bottlenet.bottles.pooled`: a warm pool's member as the table sees it.
- :mod:`~bottlenet.bottles.bottledirs`: a bottle's directory, removed as hostile ground;
  :mod:`~bottlenet.bottles.leftovers`: what a bottle that is gone left on the host.

The rule of this room: bottles composes the data plane (:mod:`bottlenet.forward`) and the
smolvm driver (:mod:`vmctl`) with the ground floor; it knows nothing of AMP, the CLI or
daemon plumbing. It takes typed values (names, addresses, specs, targets), parsed once by its
callers.
"""
