"""smolvm's disk templates, unpacked once beside its binary before the first VM start needs them.

The ``smolmachines`` wheel ships ``storage-template.ext4.zst`` and ``overlay-template.ext4.zst``
(sparse 20 GiB and 10 GiB ext4 images) next to ``smol/smol-vmm``. smolvm expands each beside
itself on the first ``machine start`` after an install (``<name>.partial``, then a rename), so
that start takes 8 to 19 s more (1.37.3 and 1.32.2, strace), and two first starts at once race
on the one ``.partial`` name (issue 38). The daemon unpacks them itself at start instead, in the
background: each under an flock of :data:`LOCK_NAME` beside them (two daemons of one install
take turns; the second finds the work done), decoded to a private name with the zero runs left
as holes, then renamed into place. smolvm then finds them and expands nothing.

Decoded with the ``zstandard`` package (a dependency of the ``vm`` extra), else the ``zstd``
CLI; with neither, or a directory the daemon may not write, nothing is done and smolvm expands
them itself, as before. Blocking: run off the reactor thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator

#: The templates smolvm expands beside its binary on its first start, each from ``<name>.zst``.
TEMPLATES = ("storage-template.ext4", "overlay-template.ext4")
#: Taken (flock, exclusive) while one is decoded: another daemon of this install waits.
LOCK_NAME = ".bottlenet-templates.lock"
#: The private name a template is decoded to before its rename (never smolvm's ``.partial``).
TMP_NAME = ".{name}.bottlenet-{pid}"
#: Seconds between tries of a lock another daemon holds (a stop is seen within one).
LOCK_POLL = 0.1
#: Bytes decoded at a time; a run of this many zeros becomes a hole.
CHUNK = 1024 * 1024
#: The most bytes one template may decode to (the 1.37.3 storage template is 20 GiB).
MAX_SIZE = 256 * 1024**3


class TemplateError(Exception):
    """A template could not be unpacked (the message says which and why)."""


class Stopped(TemplateError):
    """The unpack was stopped (the daemon is stopping); nothing half-written is left."""


def missing(directory: str) -> list[str]:
    """The templates beside a binary in ``directory`` that have a ``.zst`` but no expansion."""
    return [
        name
        for name in TEMPLATES
        if os.path.isfile(os.path.join(directory, name + ".zst"))
        and not os.path.exists(os.path.join(directory, name))
    ]


def unpackable(directory: str) -> bool:
    """Whether this daemon can unpack here: something to do, a writable directory, a decoder."""
    return (
        bool(missing(directory))
        and os.access(directory, os.W_OK | os.X_OK)
        and (_zstandard() is not None or shutil.which("zstd") is not None)
    )


def unpack(directory: str, stop: threading.Event | None = None) -> list[str]:
    """Unpack every missing template in ``directory``; the names this call unpacked (another
    daemon may have done some meanwhile). Raises TemplateError (Stopped once ``stop`` is
    set: the decode ends within a chunk)."""
    stop = stop or threading.Event()
    done = []
    for name in TEMPLATES:
        with _locked(directory, stop):
            if name not in missing(directory):
                continue
            _decode(directory, name, stop)
            done.append(name)
    return done


@contextlib.contextmanager
def _locked(directory: str, stop: threading.Event) -> Iterator[None]:
    """The install's lock, waited for (another daemon unpacking) until ``stop`` is set."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise TemplateError(f"cannot open {path}: {e.strerror}") from None
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stop.wait(LOCK_POLL):
                    raise Stopped(f"waiting for {path} was stopped") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _decode(directory: str, name: str, stop: threading.Event) -> None:
    source = os.path.join(directory, name + ".zst")
    target = os.path.join(directory, name)
    tmp = os.path.join(directory, TMP_NAME.format(name=name, pid=os.getpid()))
    try:
        module = _zstandard()
        if module is not None:
            _decode_sparse(module, source, tmp, stop)
        else:
            _decode_cli(source, tmp)
        if stop.is_set():
            raise Stopped(f"unpacking {source} was stopped")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise TemplateError(f"cannot unpack {source}: {e}") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _decode_sparse(module: object, source: str, tmp: str, stop: threading.Event) -> None:
    """Decode ``source`` to ``tmp``, every all-zero chunk a hole (the images are ~99.99%
    zeros: 30 GiB of them, about 1 MiB written)."""
    zero = bytes(CHUNK)
    with open(source, "rb") as fin, open(tmp, "xb") as fout:
        reader = module.ZstdDecompressor().stream_reader(fin)  # type: ignore[attr-defined]
        size = 0
        while not stop.is_set() and (chunk := reader.read(CHUNK)):
            size += len(chunk)
            if size > MAX_SIZE:
                raise ValueError(f"it decodes to more than {MAX_SIZE} bytes")
            if chunk == zero[: len(chunk)]:
                fout.seek(len(chunk), os.SEEK_CUR)
            else:
                fout.write(chunk)
        fout.truncate(size)
        fout.flush()
        os.fsync(fout.fileno())


def _decode_cli(source: str, tmp: str) -> None:
    subprocess.run(
        ["zstd", "-q", "-d", "--sparse", "-o", tmp, source],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
        timeout=600,
    )


def _zstandard() -> object | None:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


__all__ = [
    "LOCK_NAME",
    "TEMPLATES",
    "Stopped",
    "TemplateError",
    "missing",
    "unpack",
    "unpackable",
]
