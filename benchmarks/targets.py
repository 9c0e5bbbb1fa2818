"""Target ratios from one fwdbench JSON report (all ratios within that one run).

    python3 benchmarks/targets.py bench-out/fwdbench-STAMP.json [--peer bottlenet-splice]

Standalone peers (``bottlenet-*``) get issue 7's rows: each compares with the default peer the
issue names (systemd-socket-proxyd for bulk and CPU, haproxy for RTT, connects/s and memory).
Daemon peers (``daemon-*``, the daemon as users start it) get issue 14's: added RTT p50 at or
below the *best* default peer's and p99 at or below haproxy's, connects/s at or above the best
peer's, bulk above and CPU at or below systemd-socket-proxyd, memory per idle relay at or below
haproxy's. The idle test's note says when the daemon's per-forward cap (1,024 connections by
default) limited it. Prints markdown tables with met/missed. Standard library only.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# (label, metric key, reference peer, goal, higher is better)
ROWS = [
    ("bulk x1 MiB/s", "bulk_x1_mib_s", "systemd-socket-proxyd", 1.0, True),
    ("bulk x8 MiB/s", "bulk_parallel_mib_s", "systemd-socket-proxyd", 1.0, True),
    ("CPU s/GiB", "cpu_s_per_gib", "systemd-socket-proxyd", 1.0, False),
    ("added RTT p50 µs", "added_p50", "haproxy", 1.5, False),
    ("connects/s", "connects_per_s", "haproxy", 0.8, True),
    ("RSS KiB per idle relay", "rss_kib_per_conn", "haproxy", 1.0, False),
]


# Issue 14 (daemon rows): (label, key, reference: a peer name or "best", goal, higher better,
# strict). "best" = the best default peer on that row in this run.
DAEMON_ROWS = [
    ("bulk x1 MiB/s", "bulk_x1_mib_s", "systemd-socket-proxyd", 1.0, True, True),
    ("bulk x8 MiB/s", "bulk_parallel_mib_s", "systemd-socket-proxyd", 1.0, True, True),
    ("CPU s/GiB", "cpu_s_per_gib", "systemd-socket-proxyd", 1.0, False, False),
    ("added RTT p50 µs", "added_p50", "best", 1.0, False, False),
    ("added RTT p99 µs", "added_p99", "haproxy", 1.0, False, False),
    ("connects/s", "connects_per_s", "best", 1.0, True, False),
    ("RSS KiB per idle relay", "rss_kib_per_conn", "haproxy", 1.0, False, False),
]
DEFAULT_PEERS = (
    "socat",
    "haproxy",
    "systemd-socket-proxyd",
    "stdlib-threaded",
    "twisted-portforward",
)


def metric(target: dict[str, Any], key: str, direct: dict[str, Any]) -> float:
    m = target["metrics"]
    if key in ("added_p50", "added_p99"):
        rtt = "rtt_p50_us" if key == "added_p50" else "rtt_p99_us"
        return float(m[rtt]) - float(direct["metrics"][rtt])
    return float(m[key])


def table(report: dict[str, Any], peer: str) -> str:
    by = {t["name"]: t for t in report["targets"]}
    me, direct = by[peer], by["direct"]
    out = [
        f"| row ({peer}) | bottlenet | reference | value | ratio | goal | met |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for label, key, ref, goal, higher in ROWS:
        if ref not in by or by[ref].get("status") not in (None, "ok"):
            out.append(f"| {label} | | {ref} | n/a | | | not run |")
            continue
        mine, theirs = metric(me, key, direct), metric(by[ref], key, direct)
        ratio = mine / theirs if theirs else float("inf")
        ok = ratio >= goal if higher else ratio <= goal
        sign = "≥" if higher else "≤"
        out.append(
            f"| {label} | {mine:,.2f} | {ref} | {theirs:,.2f} | **{ratio:.2f}x** |"
            f" {sign} {goal}x | {'yes' if ok else 'NO'} |"
        )
    fds = me["metrics"].get("fds_per_conn")
    checks = me.get("checks", {})
    failed = [k for k, v in checks.items() if not v.get("ok")]
    out.append(f"| fds per idle relay | {fds} | | | | = 2 | {'yes' if fds == 2.0 else 'NO'} |")
    out.append(
        f"| harness checks | {len(checks) - len(failed)}/{len(checks)} | | | | all |"
        f" {'yes' if not failed else 'NO: ' + ', '.join(failed)} |"
    )
    return "\n".join(out)


def _ok(target: dict[str, Any]) -> bool:
    return target.get("status") in (None, "ok") and bool(target.get("metrics"))


def daemon_table(report: dict[str, Any], peer: str) -> str:
    by = {t["name"]: t for t in report["targets"]}
    me, direct = by[peer], by["direct"]
    peers = [by[n] for n in DEFAULT_PEERS if n in by and _ok(by[n])]
    out = [
        f"| row ({peer}) | daemon | reference | value | ratio | goal | met |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for label, key, ref, goal, higher, strict in DAEMON_ROWS:
        if ref == "best":
            have = [
                (metric(t, key, direct), t["name"])
                for t in peers
                if key in t["metrics"] or key.startswith("added")
            ]
            if not have:
                out.append(f"| {label} | | best peer | n/a | | | not run |")
                continue
            theirs, ref_name = max(have) if higher else min(have)
            ref_name = f"best: {ref_name}"
        elif ref in by and _ok(by[ref]):
            theirs, ref_name = metric(by[ref], key, direct), ref
        else:
            out.append(f"| {label} | | {ref} | n/a | | | not run |")
            continue
        mine = metric(me, key, direct)
        ratio = mine / theirs if theirs else float("inf")
        if higher:
            ok = ratio > goal if strict else ratio >= goal
            sign = ">" if strict else "≥"
        else:
            ok = ratio <= goal
            sign = "≤"
        out.append(
            f"| {label} | {mine:,.2f} | {ref_name} | {theirs:,.2f} | **{ratio:.2f}x** |"
            f" {sign} {goal}x | {'yes' if ok else 'NO'} |"
        )
    checks = me.get("checks", {})
    half = checks.get("half_close", {}).get("ok")
    out.append(
        f"| half-close | {'ok' if half else 'FAIL'} | | | | correct | {'yes' if half else 'NO'} |"
    )
    idle = me.get("idle") or {}
    held, asked = idle.get("opened"), idle.get("requested")
    if held is not None and asked and held < asked:
        out.append(
            f"| idle relays held | {held}/{asked} | | | | | the per-forward cap"
            f" (max_connections, default 1,024) stopped the idle test at {held}:"
            " RSS/conn is over those |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("report")
    p.add_argument("--peer", action="append", help="bottlenet peer name(s) in the report")
    args = p.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    names = [t["name"] for t in report["targets"]]
    peers = args.peer or [n for n in names if n.startswith(("bottlenet", "daemon"))]
    tables = [
        daemon_table(report, peer) if peer.startswith("daemon") else table(report, peer)
        for peer in peers
        if _ok({t["name"]: t for t in report["targets"]}[peer])
    ]
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
