"""The verdict on one gate run: a guest transcript, plus what the host saw, against the plan.

Nothing the guest prints is trusted or repeated: every line must carry this run's nonce and
have a known form, every planned check must have exactly one result, the own endpoints must
have been witnessed on the host, and messages name only endpoints, paths and names from the
plan, the guest's interface names, link kinds, addresses and routes after they were validated
(an IP literal or prefix re-rendered by ``ipaddress``, an interface name of
``[A-Za-z0-9_.-]``, a kind of ``[a-z0-9_.-]``, a route type from a fixed list).

A socket-mode guest may have no network link but ``lo``, and one more kind: a link that
provably carries nothing. libkrunfw's kernel has the ``dummy`` driver built in, so every real
smolvm guest shows ``dummy0`` (down, no address); the judge allows such a link only when the
guest's rtnetlink report says it is of kind ``dummy``, down, with no IPv4 or IPv6 address and
no route through it (:func:`link_problem`). A name is never enough.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable

from attrs import frozen

from bottlenet.probe.plan import LOOPBACKS, VSOCK_HOST_CID, IsolationMode, LayerPlan, ProbePlan

_IFACE = re.compile(r"[A-Za-z0-9_.@-]{1,15}")
_KIND = re.compile(r"[a-z0-9_.-]{1,16}")
_FLAGS = re.compile(r"[0-9a-f]{1,8}")
#: Route types as the guest's link report names them (``RTN_*``).
ROUTE_TYPES = frozenset(
    ("unicast", "local", "broadcast", "anycast", "multicast", "blackhole", "unreachable",
     "prohibit", "throw", "nat")
)  # fmt: skip
IFF_UP, IFF_LOOPBACK = 0x1, 0x8
#: The one kind of link besides ``lo`` a socket-mode guest may have (when it carries nothing).
INERT_KIND = "dummy"
ALLOWED_LINKS = "only lo, or a dummy link that is down with no address and no route, is allowed"
_HASH = re.compile(r"[0-9a-f]{64}|none")
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: The end a kit gives when its own files are not the ones the host sent the digest of.
KIT_MISMATCH = "kit-mismatch"
_CONTROLS = ("tcp", "unix", "icmp")
#: Reported only when the guest has an ICMPv6 target, and then required.
_ICMP6 = "icmp6"


class ProbeResult(enum.StrEnum):
    """The launch gate's word on a bottle, as the state file and the wire carry it."""

    PASS = "PASS"
    FAIL = "FAIL"
    #: Created with ``--unsafe-skip-isolation-probe``: no verdict at all.
    SKIPPED = "skipped"


@frozen
class Verdict:
    passed: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for logs and errors (the verdict word is the caller's)."""
        if self.passed:
            return "all checks passed" + "".join(f" ({n})" for n in self.notes)
        return "; ".join(self.problems)

    @property
    def result(self) -> ProbeResult:
        """``PASS`` or ``FAIL``."""
        return ProbeResult.PASS if self.passed else ProbeResult.FAIL

    def lines(self) -> list[str]:
        """The verdict for people: ``PASS`` or ``FAIL``, then one line per problem."""
        return (
            [self.result.value]
            + [f"  - {p}" for p in self.problems]
            + [f"  note: {n}" for n in self.notes]
        )


def _route_addr(text: str) -> str | None:
    """A guest-reported gateway or nameserver, re-rendered, or None when it is not an IP."""
    ip, sep, dev = text.partition("%")
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if sep:
        if addr.version != 6 or not _IFACE.fullmatch(dev):
            return None
        return f"{addr}%{dev}"
    return str(addr)


@frozen
class LinkReport:
    """What the guest said one link can carry (every value validated)."""

    kind: str  # "-": a device (no IFLA_INFO_KIND)
    flags: int
    addresses: list[str]
    routes: list[str]


def _some(items: list[str], shown: int = 2) -> str:
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")


def link_problem(name: str, link: LinkReport | None, unreadable: bool = False) -> str | None:
    """Why the link ``name`` may not be in a socket-mode guest, None when it may: ``lo``
    (the loopback device), or a ``dummy`` link that is down, with no address and no route."""
    if name == "lo":
        if link is not None and not link.flags & IFF_LOOPBACK:
            return "not the loopback device"
        return None
    if link is None:
        return "what it carries was not reported" + (
            " (the guest could not read rtnetlink)" if unreadable else ""
        )
    reasons = []
    if link.kind != INERT_KIND:
        reasons.append("a device, not a dummy link" if link.kind == "-" else f"kind {link.kind}")
    else:
        reasons.append(INERT_KIND)
    if link.flags & IFF_UP:
        reasons.append("up")
    if link.addresses:
        reasons.append(f"address {_some(link.addresses)}")
    if link.routes:
        reasons.append(f"routes {_some(link.routes)}")
    if reasons == [INERT_KIND]:
        return None
    return "; ".join(reasons)


def _target(kind: str, host: str, port: int) -> str:
    return f"{kind}:[{host}]:{port}" if ":" in host else f"{kind}:{host}:{port}"


class _Transcript:
    """The parsed lines of one run; ``unexpected`` counts everything that does not fit."""

    def __init__(self, plan: ProbePlan | LayerPlan, data: bytes) -> None:
        self.unexpected = 0
        self.duplicates = 0
        self.begun = False
        self.end: str | None = None
        self.tool: str | None = None
        self.plan = plan
        #: The digest the guest's kit reported of its own files.
        self.kit: str | None = None
        self.ifaces: list[str] = []
        self.bad_iface = 0
        #: The guest's rtnetlink report, by link name.
        self.links: dict[str, LinkReport] = {}
        self.links_unreadable = False
        self.controls: dict[str, str] = {}
        self.paths: list[tuple[str, str]] = []
        self.results: dict[tuple[str, str], str] = {}
        prefix = f"BNP {plan.nonce} "
        for raw in data.split(b"\n"):
            line = raw.rstrip(b"\r")
            if not line.strip():
                continue
            try:
                text = line.decode("ascii")
            except UnicodeDecodeError:
                self.unexpected += 1
                continue
            if not text.startswith(prefix) or self.end is not None:
                self.unexpected += 1
                continue
            self._take(text[len(prefix) :].split(" "))

    def _link(self, w: list[str]) -> None:
        """``link NAME KIND FLAGS``, ``addr NAME IP/LEN``, ``route NAME TYPE DEST/LEN``,
        ``links unreadable``."""
        verb, n = w[0], len(w)
        if verb == "links" and n == 2 and w[1] == "unreadable":
            self.links_unreadable = True
            return
        known = n >= 3 and w[1] in self.links
        try:
            if verb == "link" and n == 4 and _IFACE.fullmatch(w[1]) and not known:
                if (w[2] == "-" or _KIND.fullmatch(w[2])) and _FLAGS.fullmatch(w[3]):
                    self.links[w[1]] = LinkReport(w[2], int(w[3], 16), [], [])
                    return
            elif verb == "addr" and n == 3 and known:
                self.links[w[1]].addresses.append(str(ipaddress.ip_interface(w[2])))
                return
            elif verb == "route" and n == 4 and known and w[2] in ROUTE_TYPES:
                dest = ipaddress.ip_network(w[3], strict=False)
                self.links[w[1]].routes.append(f"{w[2]} {dest}")
                return
        except ValueError:
            pass
        if verb == "link" and known:
            self.duplicates += 1
        else:
            self.unexpected += 1

    def _result(self, key: tuple[str, str], value: str, allowed: Iterable[str]) -> None:
        if value not in allowed:
            self.unexpected += 1
        elif key in self.results:
            self.duplicates += 1
        else:
            self.results[key] = value

    def _take(self, w: list[str]) -> None:
        verb, n = w[0], len(w)
        if verb == "begin" and n == 2 and w[1] == "1" and not self.begun:
            self.begun = True
        elif not self.begun:
            self.unexpected += 1
        elif verb == "iface" and n == 2:
            if _IFACE.fullmatch(w[1]):
                self.ifaces.append(w[1])
            else:
                self.bad_iface += 1
        elif verb in ("link", "addr", "route", "links"):
            self._link(w)
        elif verb == "tool" and n == 2 and w[1] in ("kit", "image"):
            self.tool = w[1]
        elif verb == "kit" and n == 2 and _DIGEST.fullmatch(w[1]) and self.kit is None:
            self.kit = w[1]
        elif (
            verb == "control" and n == 3 and w[1] in (*_CONTROLS, _ICMP6) and w[2] in ("ok", "fail")
        ):
            self.controls.setdefault(w[1], w[2])
        elif verb == "path" and n == 3 and w[1] in ("gw", "ns"):
            addr = _route_addr(w[2])
            if addr is None:
                self.unexpected += 1
            elif (w[1], addr) not in self.paths:
                self.paths.append((w[1], addr))
        elif verb == "own" and n == 3:
            self._result(("own", w[1]), w[2], ("ok", "fail"))
        elif verb == "deny" and n == 3:
            self._result(("deny", w[1]), w[2], ("blocked", "reachable"))
        elif verb == "icmp" and n == 3:
            self._result(("icmp", w[1]), w[2], ("blocked", "answers"))
        elif verb == "dns" and n == 3:
            self._result(("dns", w[1]), w[2], ("blocked", "resolves"))
        elif verb == "absent" and n == 3:
            self._result(("absent", w[1]), w[2], ("ok", "present"))
        elif verb == "id" and n == 3 and w[1] in ("machine-id", "hostname"):
            if _HASH.fullmatch(w[2]):
                self._result(("id", w[1]), w[2], (w[2],))
            else:
                self.unexpected += 1
        elif verb == "redirect" and n == 3:
            self._result(("redirect", w[1]), w[2], ("connected", "failed"))
        elif verb == "connect" and n == 3:
            self._result(("connect", w[1]), w[2], ("answered", "refused", "unreachable"))
        elif verb == "ro" and n == 3:
            self._result(("ro", w[1]), w[2], ("ok", "writable"))
        elif verb == "rw" and n == 3:
            self._result(("rw", w[1]), w[2], ("ok", "fail"))
        elif verb == "end" and n == 2 and w[1] in ("pass", "fail", "blind", "notool", KIT_MISMATCH):
            self.end = w[1]
        else:
            self.unexpected += 1


def expected_deny(plan: ProbePlan, paths: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Every target the guest had to find closed (TCP, vsock, UDP), with what it stands for."""
    out: dict[str, str] = {str(t): "a denied endpoint" for t in plan.deny}
    hosts = [("loopback", a) for a in LOOPBACKS] + [
        ("default gateway" if k == "gw" else "nameserver", a) for k, a in paths
    ]
    for what, host in hosts:
        for port in plan.host_ports:
            out.setdefault(_target("tcp", host, port), f"host port {port} via the {what} {host}")
    for port in plan.host_ports:
        out.setdefault(
            f"vsock:{VSOCK_HOST_CID}:{port}",
            f"host port {port} over vsock to the host (CID {VSOCK_HOST_CID})",
        )
    for what, host in hosts:
        for port in plan.udp_ports:
            out.setdefault(
                _target("udp", host, port), f"host UDP port {port} via the {what} {host}"
            )
    out.setdefault(str(plan.outside), "the outside address")
    out.setdefault(f"udp:{str(plan.outside)[4:]}", "the outside address over UDP")
    return out


def expected_icmp(plan: ProbePlan, paths: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Every address that must not answer an echo (ICMPv6 for the IPv6 ones)."""
    out = {a: f"the default gateway {a}" for k, a in paths if k == "gw"}
    assert plan.outside.host is not None
    out.setdefault(plan.outside.host, "the outside address")
    return out


def judge(
    plan: ProbePlan,
    transcript: bytes,
    *,
    exit_code: int | None = None,
    witnessed: Iterable[str] | None = None,
    rw_seen: Iterable[str] | None = None,
) -> Verdict:
    """PASS only when every planned check ran, in this run, and found nothing.

    ``witnessed``: the own endpoints (as in the plan) whose host listener saw a connection
    carrying this run's nonce during the probe window; None when no host side watched (a
    hand check with ``--no-witness`` only). ``rw_seen``: the read-write volumes whose host
    directory held the file the guest wrote; None when the host did not look.
    """
    t = _Transcript(plan, transcript)
    problems, finished = _framing(t)
    if not finished:
        return Verdict(False, tuple(problems))
    notes = [] if plan.witness or not plan.own else ["own endpoints not witnessed on the host"]
    problems += _structure(plan, t)
    problems += _own(plan, t, witnessed)
    problems += _paths(plan, t)
    problems += _identity(plan, t, rw_seen)
    problems += _agreement(t, exit_code, clean=not problems)
    return Verdict(not problems, tuple(dict.fromkeys(problems)), tuple(notes))


def _framing(t: _Transcript) -> tuple[list[str], bool]:
    """0. The run itself: begun, bound to this run, finished, with a tool that can see
    connections. The second value is False when the rest cannot be judged."""
    problems: list[str] = []
    if not t.begun:
        problems.append("the transcript does not start with this run's begin line")
    if t.unexpected:
        problems.append(
            f"{t.unexpected} transcript line(s) not bound to this run or of no known form"
        )
    if t.duplicates:
        problems.append(f"{t.duplicates} check(s) reported more than once")
    if t.end is None:
        problems.append("the probe did not finish (no end line)")
    elif t.end == "notool":
        problems.append("the probe found no python3 in the guest (and no kit)")
    expected = getattr(t.plan, "kit", None)  # a LayerPlan names no kit
    if expected is not None and t.kit != expected:
        # The kit the guest ran is not the one the host built: nothing it said is judged.
        got = "none" if t.kit is None else t.kit[:12]
        problems.append(
            f"the guest's kit is not the one the host built (digest {got}, "
            f"expected {expected[:12]}): refused"
        )
        return problems, False
    if t.end == KIT_MISMATCH:
        problems.append("the guest's kit refused to run: its files are not the ones it was sent")
        return problems, False
    failed_controls = [c for c in _CONTROLS if t.controls.get(c) != "ok"]
    if t.end == "blind" or (t.end is not None and t.end != "notool" and failed_controls):
        which = ", ".join(failed_controls) or "unknown"
        problems.append(f"probe tool cannot detect connections (control {which} failed)")
        return problems, False
    return problems, t.end not in (None, "notool")


def _structure(plan: ProbePlan, t: _Transcript) -> list[str]:
    """1. The guest's network interfaces: named validly, listed; in socket mode each one
    (listed, or in the rtnetlink report) is lo or a link that carries nothing."""
    problems: list[str] = []
    if t.bad_iface:
        problems.append(f"{t.bad_iface} network interface(s) with an invalid name")
    if not t.ifaces:
        problems.append("the guest listed no network interfaces")
    if plan.mode == IsolationMode.SOCKET:
        for name in dict.fromkeys([*t.ifaces, *t.links]):
            why = link_problem(name, t.links.get(name), t.links_unreadable)
            if why is not None:
                problems.append(
                    f"network interface {name} in a socket-mode guest ({why}): {ALLOWED_LINKS}"
                )
    return problems


def _own(plan: ProbePlan, t: _Transcript, witnessed: Iterable[str] | None) -> list[str]:
    """2. Each own endpoint connects and (with ``plan.witness``) was witnessed on the host."""
    problems: list[str] = []
    seen = None if witnessed is None else set(witnessed)
    for target in map(str, plan.own):
        r = t.results.get(("own", target))
        if r is None:
            problems.append(f"check missing: own endpoint {target}")
        elif r != "ok":
            problems.append(f"own endpoint {target} does not connect")
        if plan.witness:
            if seen is None:
                problems.append(f"own endpoint {target}: no host-side witness for this run")
            elif target not in seen:
                problems.append(
                    f"own endpoint {target} was not witnessed on the host "
                    "(no connection carrying this run's nonce)"
                )
    return problems


def _denials(plan: ProbePlan, t: _Transcript) -> list[tuple[str, str, str, str]]:
    """Every check that must come back closed: (kind, key, the bad result, its message)."""
    deny = expected_deny(plan, t.paths)
    icmp = expected_icmp(plan, t.paths)
    checks: list[tuple[str, str, str, str]] = [
        ("deny", target, "reachable", f"leak: {target} ({what}) is reachable")
        for target, what in deny.items()
    ]
    checks += [
        (
            "icmp",
            addr,
            "answers",
            f"leak: {what} answers {'ICMPv6' if ':' in addr else 'ICMP'} echo",
        )
        for addr, what in icmp.items()
    ]
    checks += [("dns", n, "resolves", f"leak: DNS name {n} resolves") for n in plan.dns]
    checks += [
        ("absent", p, "present", f"leak: host file {p} is visible in the guest")
        for p in plan.absent
    ]
    checks += [("ro", p, "writable", f"read-only volume {p} accepts writes") for p in plan.ro]
    checks += [
        ("rw", p, "fail", f"read-write volume {p} does not round-trip a file") for p in plan.rw
    ]
    if plan.connect_via is not None:
        via = str(plan.connect_via)
        for target in plan.connect_no:
            checks.append(
                (
                    "connect",
                    target,
                    "answered",
                    f"leak: the egress proxy {via} lets CONNECT {target} through"
                    " (not on the allow-list)",
                )
            )
    return checks


def _closed(t: _Transcript, checks: Iterable[tuple[str, str, str, str]]) -> list[str]:
    """Each (kind, key, the bad result, its message) ran and did not come back bad."""
    problems = []
    for kind, key, bad, message in checks:
        r = t.results.get((kind, key))
        if r is None:
            problems.append(f"check missing: {kind} {key}")
        elif r == bad:
            problems.append(message)
    return problems


def _paths(plan: ProbePlan, t: _Transcript) -> list[str]:
    """3. Every path to the host, the outside address, ICMP, DNS, markers, volumes and the
    egress proxy: each planned check ran and found nothing; no unplanned result."""
    problems: list[str] = []
    checks = _denials(plan, t)
    if any(":" in addr for addr in expected_icmp(plan, t.paths)) and t.controls.get(_ICMP6) != "ok":
        problems.append("probe tool cannot detect ICMPv6 (control icmp6 failed or missing)")
    wanted = {(kind, key) for kind, key, _, _ in checks} | {("own", str(o)) for o in plan.own}
    problems += _closed(t, checks)
    wanted |= {("connect", c) for c in plan.connect_ok} if plan.connect_via is not None else set()
    for kind, key in t.results:
        if kind != "id" and (kind, key) not in wanted:
            problems.append(
                f"{sum(1 for k in t.results if k[0] != 'id' and k not in wanted)} "
                "result(s) for checks that were not planned"
            )
            break
    if plan.connect_via is not None:
        for target in plan.connect_ok:
            r = t.results.get(("connect", target))
            if r is None:
                problems.append(f"check missing: connect {target}")
            elif r != "answered":
                problems.append(
                    f"the egress proxy {plan.connect_via} did not answer CONNECT {target}"
                    f" (on the allow-list): {r}"
                )
    return problems


def _identity(plan: ProbePlan, t: _Transcript, rw_seen: Iterable[str] | None) -> list[str]:
    """4. The guest's machine-id and hostname are not the host's; each read-write volume's
    file reached the host (when the host looked)."""
    problems: list[str] = []
    for which in ("machine-id", "hostname"):
        r = t.results.get(("id", which))
        if r is None:
            problems.append(f"check missing: the guest's {which}")
        elif r in plan.host_ids:
            problems.append(f"the guest's {which} is the host's")
    if rw_seen is not None:
        got = set(rw_seen)
        for p in plan.rw:
            if t.results.get(("rw", p)) == "ok" and p not in got:
                problems.append(f"read-write volume {p}: the guest's file did not reach the host")
    return problems


def _agreement(t: _Transcript, exit_code: int | None, *, clean: bool) -> list[str]:
    """5. The guest's own summary and exit status agree with the above (``clean``: no
    problem found so far)."""
    problems: list[str] = []
    if clean and t.end != "pass":
        problems.append("the probe reported a failure its transcript does not show")
    if exit_code is not None and (exit_code == 0) != (t.end == "pass"):
        problems.append(f"the probe's exit status {exit_code} does not match its transcript")
    return problems


class Redirect(enum.StrEnum):
    """What became of one canary dial through the transparent egress layer. Only the host's
    witness can tell a redirect from a leak: in the guest both read "connected"."""

    #: Connected in the guest, seen at the proxy service as CONNECT, refused there.
    REDIRECTED = "redirected and refused"
    #: Connected in the guest, never seen at the proxy: it went somewhere else.
    LEAKED = "connected, never seen at the proxy"
    #: The layer did not take it (no listener, no rule, no resolver).
    NOT_TAKEN = "not taken by the layer"


def redirect_outcome(result: str | None, witnessed: bool) -> Redirect | None:
    if result == "connected":
        return Redirect.REDIRECTED if witnessed else Redirect.LEAKED
    if result == "failed":
        return Redirect.NOT_TAKEN
    return None


def judge_layer(
    plan: LayerPlan,
    transcript: bytes,
    *,
    exit_code: int | None = None,
    connects: Iterable[str] = (),
) -> Verdict:
    """PASS when every canary was redirected and refused (``connects``: the CONNECT targets
    the host's witness saw at the proxy service) and UDP and ICMP to the outside address
    stayed blocked."""
    t = _Transcript(plan, transcript)
    problems, finished = _framing(t)
    if not finished:
        return Verdict(False, tuple(problems))
    seen = set(connects)
    notes = []
    for canary in plan.canaries():
        target = plan.connect_target(canary)
        outcome = redirect_outcome(t.results.get(("redirect", canary)), target in seen)
        if outcome is None:
            problems.append(f"check missing: redirect {canary}")
        elif outcome is Redirect.REDIRECTED:
            notes.append(f"{target}: {outcome.value}")
        elif outcome is Redirect.LEAKED:
            problems.append(f"leak: canary {target} {outcome.value} (no CONNECT {target})")
        else:
            problems.append(f"transparent egress: canary {target} {outcome.value}")
    assert plan.outside.host is not None
    udp = f"udp:{str(plan.outside)[4:]}"
    checks = [
        ("deny", udp, "reachable", f"leak: {udp} (the outside address over UDP) is reachable"),
        ("icmp", plan.outside.host, "answers", "leak: the outside address answers ICMP echo"),
    ]
    problems += _closed(t, checks)
    wanted = {("redirect", c) for c in plan.canaries()} | {(k, key) for k, key, _, _ in checks}
    if any(key not in wanted for key in t.results):
        problems.append("result(s) for checks that were not planned")
    problems += _agreement(t, exit_code, clean=not problems)
    return Verdict(not problems, tuple(dict.fromkeys(problems)), tuple(notes))
