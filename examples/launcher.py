#!/usr/bin/env python3
"""An example launcher: one VM bottle for one agent session, with nothing left behind.

It creates a socket-mode VM bottle from a typed spec, prints the agent's stamped environment,
runs a command in the agent VM (an interactive shell on your terminal by default, or
``--command`` without a terminal), and destroys the bottle when the command ends, on Ctrl-C
and on SIGTERM. It exits with the command's exit code.

    python examples/launcher.py --agent-image /var/lib/bottles/agent.tar \\
        --sidecar-image registry.example/bottle-sidecar:1
    python examples/launcher.py ... --command 'echo "$HTTPS_PROXY"; id -u'

Plain Python and the blocking client: no reactor. ``--control`` takes a socket path,
``unix:PATH`` or ``tls:HOST:PORT`` (then set BOTTLENET_CONTROL_CERT, _KEY and _CA); without it,
``$BOTTLENET_CONTROL``, else the daemon's default socket (as ``bottlenetctl``).

Trying it without a KVM host (as root, on Linux; the fake smolvm is a TEST DOUBLE whose "VMs"
are host processes; with the ``exec-netns`` fault its exec runs each command in a network-less
namespace, so the launch gate has something real to check; ``unshare -n`` keeps every packet
on this machine):

    unshare -n sh -c 'ip link set lo up
      mkdir -p /tmp/bl/smolvm && chmod 700 /tmp/bl && touch /tmp/bl/agent.tar
      echo "{\"fail\": [\"exec-netns\"]}" > /tmp/bl/smolvm/fake-faults.json
      python -m twisted bottlenet --state-dir /tmp/bl/state --control /tmp/bl/c.sock \
          --smolvm tests/fakes/smolvm --smolvm-data-dir /tmp/bl/smolvm \
          --gate-outside 198.18.0.1:9 --gate-dns-name gate.invalid & daemon=$!
      sleep 3
      python examples/launcher.py --control /tmp/bl/c.sock --agent-image /tmp/bl/agent.tar \
          --sidecar-image sidecar:1 --command "echo \\$HTTPS_PROXY; exit 7"
      echo "exit $?"; kill $daemon; wait'
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

from bottlenet.cli.main import default_control
from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError
from bottlenet.control.specbuilder import Agent, BottleSpec, Service, Sidecar
from bottlenet.control.terminal import forward_winch, raw_terminal, terminal_size
from bottlenet.errors import BottlenetError, NotFound


def build_spec(args: argparse.Namespace) -> BottleSpec:
    return BottleSpec(
        mode="socket",
        sidecar=Sidecar(
            image=args.sidecar_image,
            services=[
                Service("egress", 3128, env=["HTTPS_PROXY=http://{host}:{port}"]),
                Service("git", 9418, env=["GIT_GATE_URL=http://{host}:{port}/"]),
            ],
        ),
        agent=Agent(image=args.agent_image, env=["LANG=C.UTF-8"]),
    )


def run_command(client: BlockingControlClient, name: str, args: argparse.Namespace) -> int:
    if args.command is not None:  # no terminal: stdout/stderr stream to ours
        return client.exec(
            name,
            ["/bin/sh", "-c", args.command],
            stdout=sys.stdout.buffer,
            stderr=sys.stderr.buffer,
        )
    fd = sys.stdin.fileno()
    tty = os.isatty(fd)
    session = client.open_exec(
        name, ["/bin/sh"], stdin=True, tty=tty, size=terminal_size(fd) if tty else None
    )
    with session, raw_terminal(fd if tty else None), forward_winch(session, fd if tty else None):
        return session.run(sys.stdin.buffer, sys.stdout.buffer, sys.stderr.buffer)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--control", help="control socket (default: as bottlenetctl's)")
    p.add_argument("--agent-image", required=True)
    p.add_argument("--sidecar-image", required=True)
    p.add_argument("--name", default=f"launch-{secrets.token_hex(3)}")
    p.add_argument("--command", help="run this (sh -c) without a terminal instead of a shell")
    args = p.parse_args(argv)
    args.control = args.control or default_control(os.environ)
    spec = build_spec(args)  # a bad value fails here, before the daemon is asked anything

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    client = BlockingControlClient(args.control)
    created = False
    try:
        with client:
            bottle = client.create_bottle(args.name, spec=spec.to_json())
            created = True
            print(f"bottle {bottle.name}: {bottle.state}, {bottle.isolation}", flush=True)
            for key, value in sorted(bottle.env.items()):
                print(f"  {key}={value}", flush=True)
            return run_command(client, bottle.name, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (BottlenetError, ControlConnectionError) as e:
        print(f"launcher: {e}", file=sys.stderr)
        return 1
    finally:
        if created:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup is not interrupted
            try:
                with BlockingControlClient(args.control) as c:
                    c.destroy_bottle(args.name)
                print(f"bottle {args.name} destroyed", file=sys.stderr, flush=True)
            except NotFound:
                pass
            except (BottlenetError, ControlConnectionError) as e:
                print(f"launcher: could not destroy {args.name}: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
