"""Issue 7's target ratios from one fwdbench JSON report (all ratios within that one run).

    python3 benchmarks/targets.py bench-out/fwdbench-STAMP.json [--peer bottlenet-splice]

Each row compares the bottlenet peer with the best default peer on that row (systemd-socket-
proxyd for bulk and CPU, haproxy for RTT and connects/s, as the issue names them) and prints
a markdown table with met/missed. Standard library only.
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


def metric(target: dict[str, Any], key: str, direct: dict[str, Any]) -> float:
    m = target["metrics"]
    if key == "added_p50":
        return float(m["rtt_p50_us"]) - float(direct["metrics"]["rtt_p50_us"])
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("report")
    p.add_argument("--peer", action="append", help="bottlenet peer name(s) in the report")
    args = p.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    peers = args.peer or [t["name"] for t in report["targets"] if t["name"].startswith("bottlenet")]
    print("\n\n".join(table(report, peer) for peer in peers))


if __name__ == "__main__":
    main()
