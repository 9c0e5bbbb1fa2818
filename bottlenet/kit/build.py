"""Build bottlenet's guest kit from the installed package, cached under the state directory.

The kit is the daemon's own interpreter with its own loader and shared libraries (the host's,
found by asking the loader, ``ld.so --list``), the part of the standard library the guest
programs import (found by importing them in a fresh ``-I -S`` interpreter, byte-compiled and
sourceless) and the guest programs themselves (``kit/guest.py`` as ``app/main.pyc``, the
probe, the bridge, its reach check, the session wrapper and the workload parent), and the
guest's package ``bottlenet.transparent`` (``pkg/``: the egress layer, the link report the
probe imports, the relay the bridge and the layer share). Nothing of a guest's image is
needed to run it: the kit's loader is named directly (``kit.program``).

Why not PyInstaller (+ staticx for a libc-free binary): a one-file bundle unpacks itself into
a writable ``/tmp`` at every start (0.35 s more per command here, far more under software
emulation; docs/performance.md), a read-only root has none, and staticx refuses this host's
interpreter (its extension modules carry a ``DT_RUNPATH``). A directory with its own loader
starts as fast as the interpreter itself and runs from a read-only mount.

The cache: ``<state-dir>/kit/<key>/``, the key a hash of every input (the layout, the
interpreter and each library and module file by path, size and mtime, and the bytes of the
guest programs and of the package's modules), so a change of any input builds a new kit.
Next to it ``<key>.digest``, the tree digest taken when it was built
(``guest.tree_digest``); a kit whose files no longer give that digest is built again, never
used as it is. Kits of older inputs are removed at the daemon's start (:meth:`KitCache.prune`)
unless a live bottle mounts one or another daemon sharing the cache uses it (each daemon
holds a shared lock on ``<key>.use`` of the kits it uses). Blocking: run it off the reactor
thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import py_compile
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from importlib import resources

from attrs import field, frozen
from twisted.logger import Logger

from bottlenet.errors import BottlenetError
from bottlenet.kit import guest
from bottlenet.kit.program import LIB, MAIN, PYTHON, KitProgram, KitRef

#: Bump when build() changes what goes into a kit.
LAYOUT = 2
#: The state directory's kit folder.
KITS = "kit"
#: In it: the lock every cache change is made under, and beside each ``<key>`` kit its
#: ``<key>.digest`` and ``<key>.use`` (held with a shared lock by each daemon using the kit).
LOCK, USE = ".lock", ".use"
_KEY = re.compile(r"[0-9a-f]{16}")
#: Each guest program: its name in the kit's ``app/`` and where its source is.
PROGRAMS = {
    "main": ("bottlenet.kit", "guest.py"),
    "probe": ("bottlenet.probe", "guest.py"),
    "bridge": ("bottlenet.bridge", "guest.py"),
    "reach": ("bottlenet.bridge", "reach.py"),
    "parent": ("bottlenet.kit", "parent.py"),
}
#: The package the kit ships whole (``pkg/``), but its host-side modules.
PACKAGE = "bottlenet.transparent"
HOST_ONLY = ("script.py", "__main__.py")
#: Imported inside functions of the guest programs (the rest is found by running them);
#: ``encodings.idna`` is what ``socket.getaddrinfo`` encodes a name with (without it every
#: lookup fails with LookupError, and the gate's DNS check could not see a name resolve).
LATE_IMPORTS = (
    "encodings.idna",
    "hashlib",
    "json",
    "marshal",
    "pwd",
    "select",
    "signal",
    "errno",
    "stat",
    "os",
    "sys",
    "time",
)
#: Run by the kit's interpreter to name the files the guest programs need (stdin: sources).
_COLLECT = """\
import json, sys
sources, PKG, MODULES, LATE = json.loads(sys.stdin.read())
sys.path.insert(0, PKG)
for m in MODULES:
    __import__(m)
for name, text in sorted(sources.items()):
    if name == "session":  # all top-level code: its imports are among the late ones
        continue
    exec(compile(text, name, "exec"), {"__name__": "bottlenet_kit_collect"})
for m in LATE:
    __import__(m)
files = sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
import sysconfig
print(json.dumps({"files": files, "stdlib": sysconfig.get_path("stdlib"),
                  "dynload": sysconfig.get_path("platstdlib") + "/lib-dynload",
                  "version": "%d.%d" % sys.version_info[:2]}))
"""


class KitUnavailable(BottlenetError):
    """No kit can be built here (the reason says why): guest commands use the image's
    python3 and /bin/sh."""

    code = "KIT_UNAVAILABLE"


@frozen
class Kit:
    """One built kit: its host root, cache key, tree digest, machine and size."""

    root: str
    key: str
    digest: str
    machine: str
    loader: str
    size: int
    #: Seconds the build took (0 when it came from the cache).
    built_in: float = 0.0

    @property
    def program(self) -> KitProgram:
        """The program as a guest runs it (at the fixed guest path)."""
        return KitProgram(self.loader)

    @property
    def ref(self) -> KitRef:
        """What a bottle records of the kit it mounted."""
        return KitRef(self.digest, self.loader)

    @property
    def host_program(self) -> KitProgram:
        """The same program at its host root (the self-test and tests run it here)."""
        return KitProgram(self.loader, self.root)

    def describe(self) -> str:
        return (
            f"kit {self.digest[:12]} ({self.machine}, {self.size / 2**20:.1f} MiB) at {self.root}"
        )


def elf_facts(path: str) -> tuple[str, str]:
    """``(machine, PT_INTERP)`` of an ELF64 little-endian program (KitUnavailable else)."""
    machines = {62: "x86_64", 183: "aarch64"}
    with open(path, "rb") as fh:
        head = fh.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise KitUnavailable(f"{path} is not a 64-bit little-endian ELF program")
        machine = machines.get(struct.unpack_from("<H", head, 18)[0])
        if machine is None:
            raise KitUnavailable(f"{path}: an ELF machine the kit does not know")
        phoff, phentsize, phnum = (
            struct.unpack_from("<Q", head, 32)[0],
            *struct.unpack_from("<HH", head, 54),
        )
        for i in range(phnum):
            fh.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", fh.read(40))
            if p_type == 3:  # PT_INTERP
                fh.seek(p_offset)
                return machine, fh.read(p_filesz).rstrip(b"\0").decode()
    raise KitUnavailable(f"{path} is statically linked: the kit needs its loader")


def interpreter() -> str:
    """The daemon's own interpreter (a venv's python is a link to it)."""
    return os.path.realpath(sys.executable)


def sources() -> dict[str, str]:
    """The guest programs' source text, by their name in the kit."""
    from vmctl.sessionend import WRAPPER

    texts = {
        name: resources.files(package).joinpath(file).read_text()
        for name, (package, file) in PROGRAMS.items()
    }
    texts["session"] = WRAPPER
    return texts


def package_sources() -> dict[str, str]:
    """The shipped package's modules, by their path under ``pkg/`` (its parent package's
    ``__init__`` an empty one)."""
    room = resources.files(PACKAGE)
    base = PACKAGE.replace(".", "/")
    texts = {f"{base.rpartition('/')[0]}/__init__.py": ""}
    for item in sorted(room.iterdir(), key=lambda i: i.name):
        if item.name.endswith(".py") and item.name not in HOST_ONLY:
            texts[f"{base}/{item.name}"] = item.read_text()
    return texts


def _module_names(package: dict[str, str]) -> list[str]:
    return [path[:-3].replace("/", ".").removesuffix(".__init__") for path in sorted(package)]


def _run(argv: list[str], stdin: str | None = None) -> str:
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KitUnavailable(f"{argv[0]} could not run: {e}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise KitUnavailable(f"{os.path.basename(argv[0])} failed (exit {p.returncode}): {last}")
    return p.stdout


@frozen
class Inputs:
    """What one kit is made of (found, not yet copied)."""

    python: str
    machine: str
    loader: str
    #: ``lib/python3.X`` relative path -> the host file (modules and extension modules).
    modules: dict[str, str]
    #: soname -> host file
    libraries: dict[str, str]
    sources: dict[str, str]
    pyversion: str
    #: ``pkg/`` relative path -> source text (the package the guest programs import).
    package: dict[str, str] = field(factory=dict)

    def key(self) -> str:
        strip = shutil.which("strip")
        h = hashlib.sha256(
            f"bottlenet-kit {LAYOUT} {guest.FORMAT} {sys.version} {strip}\n".encode()
        )
        files = [self.python, self.loader, *self.modules.values(), *self.libraries.values()]
        for path in sorted(set(files)):
            st = os.stat(path)
            h.update(f"{path} {st.st_size} {st.st_mtime_ns}\n".encode())
        for name, text in sorted({**self.sources, **self.package}.items()):
            h.update(f"{name} {len(text)}\n".encode() + text.encode())
        return h.hexdigest()[:16]


def libraries_of(loader: str, binaries: list[str]) -> dict[str, str]:
    """soname -> path of every shared library ``binaries`` need, as the loader resolves them."""
    found: dict[str, str] = {}
    for b in binaries:
        for line in _run([loader, "--list", b]).splitlines():
            name, arrow, rest = line.strip().partition(" => ")
            path = rest.split(" (")[0].strip()
            if arrow and path.startswith("/"):
                found[name] = os.path.realpath(path)
    return found


def find_inputs(python: str | None = None) -> Inputs:
    """Everything a kit of ``python`` (default: the daemon's) needs, found on this host."""
    python = python or interpreter()
    machine, loader = elf_facts(python)
    if machine != os.uname().machine:
        raise KitUnavailable(
            f"the interpreter is built for {machine} but this host is {os.uname().machine}"
        )
    texts, package = sources(), package_sources()
    with tempfile.TemporaryDirectory() as pkg:
        _write_tree(pkg, package)
        collected = json.loads(
            _run(
                [python, "-I", "-S", "-X", "utf8", "-c", _COLLECT],
                stdin=json.dumps([texts, pkg, _module_names(package), LATE_IMPORTS]),
            )
        )
    stdlib, dynload, version = collected["stdlib"], collected["dynload"], collected["version"]
    modules: dict[str, str] = {}
    for f in collected["files"]:
        if f.startswith(pkg + "/"):
            continue  # the package itself: shipped from its sources
        if f.startswith(dynload + "/"):
            modules[f"lib-dynload/{os.path.basename(f)}"] = f
        elif f.startswith(stdlib + "/") and f.endswith(".py"):
            modules[os.path.relpath(f, stdlib) + "c"] = f
        else:
            raise KitUnavailable(f"a guest program imports {f}, outside the standard library")
    binaries = [python, *(f for f in modules.values() if f.endswith(".so"))]
    libs = libraries_of(loader, binaries)
    libs.pop(os.path.basename(loader), None)
    return Inputs(python, machine, os.path.realpath(loader), modules, libs, texts, version, package)


def _write_tree(root: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)


def _copy(src: str, dest: str, mode: int) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(src, dest)
    os.chmod(dest, mode)


def _compile(src: str, dest: str, shown: str) -> None:
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    py_compile.compile(
        src,
        cfile=dest,
        dfile=shown,
        doraise=True,
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    os.chmod(dest, 0o444)


def _strip(paths: list[str]) -> None:
    """Debug symbols dropped (binutils' ``strip``, where the host has it): a pyenv
    interpreter's libpython is 23 MB with them, 4 MB without, and the guest reads every
    byte of the kit at each gate (its digest)."""
    tool = shutil.which("strip")
    if tool is None:
        return
    for path in paths:
        os.chmod(path, 0o644)
        subprocess.run([tool, "--strip-unneeded", path], capture_output=True, timeout=120)


def build(inputs: Inputs, dest: str) -> None:
    """Write the kit into the new directory ``dest``."""
    loader_name = os.path.basename(elf_facts(inputs.python)[1])
    _copy(inputs.loader, os.path.join(dest, LIB, loader_name), 0o555)
    _copy(inputs.python, os.path.join(dest, PYTHON), 0o555)
    for soname, path in inputs.libraries.items():
        _copy(path, os.path.join(dest, LIB, soname), 0o444)
    shared = [os.path.join(dest, LIB, soname) for soname in inputs.libraries]
    _strip([os.path.join(dest, PYTHON), *shared])
    os.chmod(os.path.join(dest, PYTHON), 0o555)
    for path in shared:
        os.chmod(path, 0o444)
    stdlib = os.path.join(dest, LIB, f"python{inputs.pyversion}")
    for rel, path in inputs.modules.items():
        if rel.startswith("lib-dynload/"):
            _copy(path, os.path.join(stdlib, rel), 0o444)
        else:
            _compile(path, os.path.join(stdlib, rel), f"<kit>/{rel[:-1]}")
    with tempfile.TemporaryDirectory() as src:
        for name, text in inputs.sources.items():
            path = os.path.join(src, f"{name}.py")
            with open(path, "w") as fh:
                fh.write(text)
            dest_name = MAIN if name == "main" else f"app/{name}.pyc"
            _compile(path, os.path.join(dest, dest_name), f"bottlenet-kit/{name}.py")
        _write_tree(os.path.join(src, guest.PKG), inputs.package)
        for rel in inputs.package:
            shown = f"bottlenet-kit/{guest.PKG}/{rel}"
            _compile(
                os.path.join(src, guest.PKG, rel), os.path.join(dest, guest.PKG, rel + "c"), shown
            )
    info = {"format": guest.FORMAT, "machine": inputs.machine, "loader": f"{LIB}/{loader_name}"}
    with open(os.path.join(dest, "kit.json"), "w") as fh:
        json.dump(info, fh, sort_keys=True)
    os.chmod(os.path.join(dest, "kit.json"), 0o444)
    for top, dirs, _files in os.walk(dest):
        for d in dirs:
            os.chmod(os.path.join(top, d), 0o555)
    os.chmod(dest, 0o555)


def _recorded(base: str) -> str | None:
    """The digest recorded at a kit's build (None: none readable)."""
    try:
        with open(base + ".digest") as fh:
            return fh.read(128).strip()
    except OSError:
        return None


def tree_size(root: str) -> int:
    total = 0
    for top, _dirs, files in os.walk(root):
        total += sum(os.lstat(os.path.join(top, f)).st_size for f in files)
    return total


def _make_writable(root: str) -> None:
    for top, dirs, _files in os.walk(root):
        os.chmod(top, 0o755)
        for d in dirs:
            os.chmod(os.path.join(top, d), 0o755)


def remove(root: str) -> None:
    """A kit directory (its folders are read-only) removed; nothing raised."""
    if os.path.isdir(root) and not os.path.islink(root):
        try:
            _make_writable(root)
        except OSError:
            pass
        shutil.rmtree(root, ignore_errors=True)


class KitCache:
    """The kits under ``<state_dir>/kit``: the current one found, checked or built."""

    log = Logger()

    def __init__(self, state_dir: str, python: str | None = None) -> None:
        self.dir = os.path.join(state_dir, KITS)
        self.python = python
        #: key -> the descriptor holding ``<key>.use`` (shared): the kits this daemon uses.
        self.held: dict[str, int] = {}

    def _kit(self, key: str, digest: str, built_in: float = 0.0) -> Kit:
        root = os.path.join(self.dir, key)
        with open(os.path.join(root, "kit.json")) as fh:
            info = json.load(fh)
        return Kit(root, key, digest, info["machine"], info["loader"], tree_size(root), built_in)

    def ensure(self) -> Kit:
        """The kit of today's inputs: the cached one when its files still give the digest
        recorded at its build, else a new build (held in use from then on: :meth:`prune`s
        of other daemons sharing the cache leave it). KitUnavailable when none can be
        built."""
        inputs = find_inputs(self.python)
        key = inputs.key()
        with self._locked():
            kit = self.cached(key) or self.build(inputs, key)
            self._hold(key)
            return kit

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The cache's lock: daemons sharing one cache build, hold and prune one at a time."""
        try:
            os.makedirs(self.dir, mode=0o755, exist_ok=True)
            lock = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's cache: its kits can still be used
            lock = os.open(os.path.join(self.dir, LOCK), os.O_RDONLY)
        except OSError as e:
            raise KitUnavailable(f"cannot use {self.dir}: {e.strerror or e}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)

    def _hold(self, key: str) -> None:
        """Mark the kit ``key`` in use by this daemon (a shared lock on ``<key>.use``, kept
        until :meth:`release`); a cache this user may not write is used unmarked."""
        if key in self.held:
            return
        try:
            fd = os.open(os.path.join(self.dir, key + USE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_SH)
        self.held[key] = fd

    def release(self) -> None:
        """This daemon uses none of the cache's kits any more (it stops)."""
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()

    def prune(self, keep: Collection[str] = ()) -> list[str]:
        """Remove the kits of other keys that no daemon holds in use and whose digest is not
        in ``keep`` (the kits the daemon's live bottles mount: held from now on), and what
        a build that died left; the keys removed. Blocking: a walk of the cache."""
        removed: list[str] = []
        with self._locked():
            names = os.listdir(self.dir)
            for name in names:
                if name.startswith(".build-"):  # no build runs while the lock is held
                    remove(os.path.join(self.dir, name))
            for key in sorted({n.partition(".")[0] for n in names} - {""}):
                if not _KEY.fullmatch(key):
                    continue
                if key in self.held:
                    continue
                if _recorded(os.path.join(self.dir, key)) in keep:
                    self._hold(key)
                elif self._remove_unused(key):
                    removed.append(key)
        return removed

    def _remove_unused(self, key: str) -> bool:
        """Remove the kit ``key`` unless a daemon holds it in use."""
        base = os.path.join(self.dir, key)
        fd = os.open(base + USE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another daemon uses it
            remove(base)
            for leftover in (base + ".digest", base + USE):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            return True
        finally:
            os.close(fd)

    def cached(self, key: str) -> Kit | None:
        root = os.path.join(self.dir, key)
        try:
            with open(root + ".digest") as fh:
                recorded = fh.read().strip()
            if os.path.isdir(root) and guest.tree_digest(root) == recorded:
                return self._kit(key, recorded)
        except (OSError, ValueError, KeyError):
            pass
        if os.path.lexists(root):
            self.log.warn(
                "kit {key} changed on disk since it was built: building it again", key=key
            )
        return None

    def build(self, inputs: Inputs, key: str) -> Kit:
        started = time.monotonic()
        work = tempfile.mkdtemp(prefix=".build-", dir=self.dir)
        try:
            stage = os.path.join(work, key)
            build(inputs, stage)
            digest = guest.tree_digest(stage)
            root = os.path.join(self.dir, key)
            if os.path.lexists(root):
                aside = os.path.join(work, "old")
                os.rename(root, aside)
            os.rename(stage, root)
            with open(root + ".digest.tmp", "w") as fh:
                fh.write(digest + "\n")
            os.replace(root + ".digest.tmp", root + ".digest")
        except OSError as e:
            raise KitUnavailable(f"cannot build the kit in {self.dir}: {e.strerror or e}") from None
        finally:
            remove(work)
        kit = self._kit(key, digest, time.monotonic() - started)
        self.log.info("built {kit} in {seconds:.1f} s", kit=kit.describe(), seconds=kit.built_in)
        return kit

    def verify(self, kit: Kit) -> bool:
        """The kit's files still give its digest (blocking: a full read)."""
        try:
            return guest.tree_digest(kit.root) == kit.digest
        except OSError:
            return False
