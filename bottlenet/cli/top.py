"""``bottlenetctl top``: a live view of bottles, forwards, relays and throughput.

Plain blocking calls (ListBottles, ListForwards, Stats) once per interval; throughput is the
difference of two successive ``Stats`` snapshots divided by the time between them. On a
terminal each frame redraws the screen in place with plain ANSI (home, clear to end of line
and screen; the cursor is hidden while it runs and shown again on exit). Anything else (a
pipe, a file) gets the frames one after the other with no escape sequences.

Ctrl-C (SIGINT) and a closed stdout both end it with exit status 0 and no traceback. When the
daemon goes away the screen says so and it keeps retrying; ``--once`` exits 3 instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from io import StringIO
from typing import Any, TextIO

import attrs
from attrs import frozen

from bottlenet.cli.invocation import Invocation, every
from bottlenet.cli.output import EXIT_OK, report_control_error, table_lines
from bottlenet.cli.output import clean as _clean
from bottlenet.control import calls
from bottlenet.control.blocking import BlockingControlClient, ControlConnectionError
from bottlenet.control.records import BottleRecord, ForwardRecord, StatsRecord
from bottlenet.errors import BottlenetError

_HOME = "\x1b[H"
_CLEAR_EOL = "\x1b[K"
_CLEAR_EOS = "\x1b[J"
_HIDE_CURSOR = "\x1b[?25l"
_SHOW_CURSOR = "\x1b[?25h"

Key = tuple[str, str]


@frozen
class Snapshot:
    """What the daemon reported at one moment (``at`` is a monotonic time)."""

    at: float
    version: str
    bottles: tuple[BottleRecord, ...]
    forwards: tuple[ForwardRecord, ...]
    stats: tuple[StatsRecord, ...]


def take_snapshot(
    client: BlockingControlClient, version: str, clock: Callable[[], float] = time.monotonic
) -> Snapshot:
    """Every page of bottles, forwards and stats; ``at`` is taken right after Stats."""
    bottles = tuple(every(client, calls.list_bottles))
    forwards = tuple(every(client, lambda o: calls.list_forwards(None, o)))
    stats = tuple(every(client, lambda o: calls.stats(None, o)))
    return Snapshot(clock(), version, bottles, forwards, stats)


def rates(prev: Snapshot | None, cur: Snapshot) -> dict[Key, tuple[float, float]]:
    """Bytes per second each way (in = agent to target) per forward since ``prev``.

    A forward missing from ``prev``, or whose counters went backwards (removed and added
    again), has no rate yet.
    """
    if prev is None or cur.at <= prev.at:
        return {}
    dt = cur.at - prev.at
    before = {(s.bottle, s.label): s for s in prev.stats}
    out: dict[Key, tuple[float, float]] = {}
    for s in cur.stats:
        p = before.get((s.bottle, s.label))
        if p is None or s.bytes_in < p.bytes_in or s.bytes_out < p.bytes_out:
            continue
        out[(s.bottle, s.label)] = (
            (s.bytes_in - p.bytes_in) / dt,
            (s.bytes_out - p.bytes_out) / dt,
        )
    return out


def human_bytes(n: float, suffix: str = "") -> str:
    """``1.5 KiB`` style, exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B{suffix}"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}{suffix}"


def _rate(r: tuple[float, float] | None, i: int) -> str:
    return "-" if r is None else human_bytes(r[i], "/s")


def _sum(values: Iterable[tuple[float, float]]) -> tuple[float, float]:
    total_in = total_out = 0.0
    for a, b in values:
        total_in += a
        total_out += b
    return total_in, total_out


def render(
    snap: Snapshot, prev: Snapshot | None, *, path: str, interval: float, now: str
) -> list[str]:
    """One frame as lines: a summary, the bottles table and the forwards table."""
    per_forward = rates(prev, snap)
    forwards = {(f.bottle, f.label): f for f in snap.forwards}
    active = sum(s.active for s in snap.stats)
    total = _sum(per_forward.values()) if prev is not None else None
    lines = [
        f"bottlenet {_clean(snap.version)}  {_clean(path)}  {now}  every {interval:g}s"
        "  (Ctrl-C to quit)",
        f"bottles {len(snap.bottles)}  forwards {len(snap.stats)}  active relays {active}"
        f"  in {_rate(total, 0)}  out {_rate(total, 1)}",
        "",
    ]
    by_bottle: dict[str, list[StatsRecord]] = {}
    for s in snap.stats:
        by_bottle.setdefault(s.bottle, []).append(s)
    bottle_rows = []
    for b in snap.bottles:
        mine = by_bottle.get(b.name, [])
        known = [
            per_forward[(s.bottle, s.label)] for s in mine if (s.bottle, s.label) in per_forward
        ]
        r = _sum(known) if prev is not None and len(known) == len(mine) else None
        bottle_rows.append(
            [
                b.name,
                b.alias or "-",
                b.state,
                b.forwards,
                sum(s.active for s in mine),
                _rate(r, 0),
                _rate(r, 1),
            ]
        )
    lines += table_lines(
        ["BOTTLE", "ALIAS", "STATE", "FORWARDS", "ACTIVE", "IN/s", "OUT/s"], bottle_rows
    )
    lines.append("")
    forward_rows = []
    for s in snap.stats:
        key = (s.bottle, s.label)
        f = forwards.get(key)
        r = per_forward.get(key)
        # What moves first, the long addresses last: at 80 columns the rates stay in view.
        forward_rows.append(
            [
                s.bottle,
                s.label,
                _rate(r, 0),
                _rate(r, 1),
                human_bytes(s.bytes_in),
                human_bytes(s.bytes_out),
                s.active,
                s.accepted,
                s.refused,
                s.failed,
                s.endpoint,
                f.target if f is not None else "?",
            ]
        )
    headers = ["BOTTLE", "LABEL", "IN/s", "OUT/s", "IN", "OUT", "ACTIVE", "ACCEPTED", "REFUSED"]
    headers += ["FAILED", "ENDPOINT", "TARGET"]
    lines += table_lines(headers, forward_rows)
    return lines


def render_unreachable(path: str, reason: str, interval: float, now: str) -> list[str]:
    return [
        f"bottlenet ?  {_clean(path)}  {now}  every {interval:g}s  (Ctrl-C to quit)",
        "",
        f"daemon unreachable: {_clean(reason)}",
        f"retrying every {interval:g}s",
    ]


def frame_json(snap: Snapshot, prev: Snapshot | None) -> dict[str, Any]:
    """The frame for ``--json``: records plus ``in_rate``/``out_rate`` (None until known)."""
    per_forward = rates(prev, snap)
    stats = []
    for s in snap.stats:
        r = per_forward.get((s.bottle, s.label))
        d = attrs.asdict(s)
        d["in_rate"], d["out_rate"] = (r[0], r[1]) if r is not None else (None, None)
        stats.append(d)
    return {
        "version": snap.version,
        "bottles": [attrs.asdict(b) for b in snap.bottles],
        "forwards": [attrs.asdict(f) for f in snap.forwards],
        "stats": stats,
        "interval": None if prev is None else snap.at - prev.at,
    }


class _Screen:
    """Writes frames: in place on a terminal, one after the other otherwise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        try:
            self.tty = out.isatty()
        except (ValueError, OSError):
            self.tty = False
        self._started = False

    def start(self) -> None:
        if self.tty:
            self.out.write(_HIDE_CURSOR)
            self._started = True

    def draw(self, lines: list[str]) -> None:
        if not self.tty:
            self.out.write("\n".join(lines) + "\n\n")
            self.out.flush()
            return
        size = shutil.get_terminal_size()
        shown = [line[: size.columns] for line in lines[: max(1, size.lines - 1)]]
        buf = StringIO()
        buf.write(_HOME)
        for line in shown:
            buf.write(line + _CLEAR_EOL + "\n")
        buf.write(_CLEAR_EOS)
        self.out.write(buf.getvalue())
        self.out.flush()

    def restore(self) -> None:
        if self._started:
            self._started = False
            self.out.write(_SHOW_CURSOR)
            self.out.flush()


def _silence_stdout(out: TextIO) -> None:
    """After EPIPE: point fd 1 at /dev/null so the interpreter's final flush cannot fail."""
    if out is not sys.stdout:
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _now() -> str:
    return datetime.now().strftime("%H:%M:%S")


def run_once(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """Two snapshots ``--interval`` apart, one frame; exit 3 if the daemon is unreachable."""
    path, interval = inv.path, inv.options.interval
    try:
        with inv.blocking_client() as client:
            version = client.hello().server_version
            first = take_snapshot(client, version)
            time.sleep(interval)
            snap = take_snapshot(client, version)
    except (ControlConnectionError, BottlenetError) as e:
        return report_control_error(e, path, err, as_json=inv.json)
    if inv.json:
        out.write(json.dumps(frame_json(snap, first), sort_keys=True) + "\n")
    else:
        out.write("\n".join(render(snap, first, path=path, interval=interval, now=_now())))
        out.write("\n")
    out.flush()
    return EXIT_OK


def run_live(inv: Invocation, out: TextIO, err: TextIO) -> int:
    """Redraw every ``--interval`` seconds until Ctrl-C or a closed stdout."""
    path, interval = inv.path, inv.options.interval
    screen = _Screen(out)
    client: BlockingControlClient | None = None
    version = "?"
    prev: Snapshot | None = None
    try:
        screen.start()
        while True:
            started = time.monotonic()
            try:
                if client is None:
                    client = inv.blocking_client().connect()
                    version = client.hello().server_version
                snap = take_snapshot(client, version)
                if inv.json:
                    lines = [json.dumps(frame_json(snap, prev), sort_keys=True)]
                else:
                    lines = render(snap, prev, path=path, interval=interval, now=_now())
                prev = snap
            except ControlConnectionError as e:
                if client is not None:
                    client.close()
                client, prev = None, None
                lines = render_unreachable(path, str(e), interval, _now())
            except BottlenetError as e:
                lines = [f"error: {_clean(e.code)}: {_clean(e.message)}"]
            if inv.json and not screen.tty:
                out.write(lines[0] + "\n")
                out.flush()
            else:
                screen.draw(lines)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        _silence_stdout(out)
        return EXIT_OK
    finally:
        if client is not None:
            client.close()
        try:
            screen.restore()
        except (BrokenPipeError, ValueError, OSError):
            _silence_stdout(out)
    try:
        if screen.tty:
            out.write("\n")
            out.flush()
    except (BrokenPipeError, ValueError, OSError):
        _silence_stdout(out)
    return EXIT_OK


def run(inv: Invocation, out: TextIO, err: TextIO) -> int:
    if inv.options.once:
        try:
            return run_once(inv, out, err)
        except KeyboardInterrupt:
            return EXIT_OK
        except BrokenPipeError:
            _silence_stdout(out)
            return EXIT_OK
    return run_live(inv, out, err)
