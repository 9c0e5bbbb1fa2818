"""Unit tests for vmctl.spec: validation rejects, device budget, argv for every flag."""

from __future__ import annotations

import os
import tempfile

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from vmctl.errors import DeviceBudgetExceeded, InvalidArgument
from vmctl.spec import (
    MachineSpec,
    MountSocket,
    PortMapping,
    Volume,
    create_args,
    devices,
    exec_args,
    parse_pair,
    validate_name,
    validate_spec,
)


class NameTests(SynchronousTestCase):
    def test_valid(self) -> None:
        for n in ("a", "A1", "bottle-1_side", "x" * 128, "9lives"):
            self.assertEqual(validate_name(n), n)

    def test_invalid(self) -> None:
        for n in ("", "-f", "--name", "_a", "a-", "a--b", "a b", "a.b", "x" * 129, "é", "a\n"):
            with self.assertRaises(InvalidArgument, msg=repr(n)) as cm:
                validate_name(n)
            self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")

    @given(st.text(max_size=140))
    def test_accepted_names_never_look_like_flags(self, n: str) -> None:
        try:
            validate_name(n)
        except InvalidArgument:
            return
        self.assertFalse(n.startswith("-"))
        self.assertNotIn("--", n)
        self.assertTrue(1 <= len(n) <= 128)


class PartTests(SynchronousTestCase):
    def test_ports(self) -> None:
        self.assertEqual(PortMapping.parse("8080:80"), PortMapping(8080, 80))
        for bad in (
            "80",
            "127.0.0.1:8080:80",
            "0:80",
            "80:0",
            "65536:1",
            "a:1",
            "80/tcp:1",
            "+1:2",
            " 1:2",
            "1:2:3",
            chr(0x661) + ":2",
        ):
            self.assertRaises(InvalidArgument, PortMapping.parse, bad)
        self.assertRaises(InvalidArgument, PortMapping, 0, 1)
        self.assertRaises(InvalidArgument, PortMapping, True, 1)

    def test_volumes(self) -> None:
        self.assertEqual(Volume.parse("/h:/g:ro"), Volume("/h", "/g", True))
        self.assertEqual(Volume.parse("/h:/g:rw"), Volume("/h", "/g", False))
        self.assertEqual(Volume.parse("/h:/g").arg(), "/h:/g")
        for bad in ("/h", "/h:g", "h:/g", "/h:/g:rx", "/h:/g:ro:x", "/h\n:/g"):
            self.assertRaises(InvalidArgument, Volume.parse, bad)

    def test_volume_host_must_be_directory(self) -> None:
        d = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, d)
        Volume(d, "/w").check_host()
        self.assertRaises(InvalidArgument, Volume(d + "/missing", "/w").check_host)
        fd, f = tempfile.mkstemp()
        os.close(fd)
        self.addCleanup(os.unlink, f)
        self.assertRaises(InvalidArgument, Volume(f, "/w").check_host)

    def test_mount_sockets(self) -> None:
        self.assertEqual(MountSocket.parse("/h/s.sock:/run/s.sock").arg(), "/h/s.sock:/run/s.sock")
        for bad in ("/h", "h:/g", "/h:g", "/h:/g;rm", "/h:/g|x", "/h:/g:x"):
            self.assertRaises(InvalidArgument, MountSocket.parse, bad)

    def test_pairs(self) -> None:
        self.assertEqual(parse_pair("K=V=W", "env"), ("K", "V=W"))
        self.assertRaises(InvalidArgument, parse_pair, "K", "env")


def spec(**kw: object) -> MachineSpec:
    return MachineSpec(name=kw.pop("name", "m1"), **kw)  # type: ignore[arg-type]


class ValidateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dirs = [tempfile.mkdtemp() for _ in range(5)]
        for d in self.dirs:
            self.addCleanup(os.rmdir, d)

    def vols(self, n: int) -> list[Volume]:
        return [Volume(d, f"/m{i}") for i, d in enumerate(self.dirs[:n])]

    def test_ok(self) -> None:
        s = spec(
            ports=[PortMapping(1, 2)],
            volumes=self.vols(2),
            labels={"owner": "bn"},
            env={"A_1": "x=y\nz"},
            image="alpine",
            cpus=2,
            mem=512,
            workdir="/w",
            allow_cidrs=["10.0.0.0/8", "1.2.3.4", "::1"],
            allow_hosts=["example.com"],
        )
        self.assertIs(validate_spec(s), s)

    def test_rejects(self) -> None:
        bad = [
            spec(name="-x"),
            spec(image="-"),
            spec(image="--net"),
            spec(image="a", from_file="/p.smolmachine"),
            spec(from_file="rel.smolmachine"),
            spec(labels={"a=b": "c"}),
            spec(labels={"": "c"}),
            spec(labels={"-a": "c"}),
            spec(labels={"a": "c\nd"}),
            spec(labels={"a b": "c"}),
            spec(labels=[("a", "1"), ("a", "2")]),
            spec(cpus=0),
            spec(cpus=17),
            spec(mem=63),
            spec(volumes=[Volume("/nonexistent-dir-xyz", "/g")]),
            spec(volumes=[Volume(self.dirs[0], "/g"), Volume(self.dirs[1], "/g")]),
            spec(ports=[PortMapping(1, 2), PortMapping(1, 3)]),
            spec(env={"1A": "x"}),
            spec(env={"A-B": "x"}),
            spec(env={"A": "x\0"}),
            spec(workdir="rel"),
            spec(net_backend="virtio"),
            spec(allow_cidrs=["10.0.0.0/33"]),
            spec(allow_cidrs=["example.com"]),
            spec(allow_hosts=["example.com:443"]),
            spec(allow_hosts=["-x"]),
            spec(allow_hosts=["a b"]),
            spec(workload=["a\0b"]),
        ]
        for s in bad:
            with self.assertRaises(InvalidArgument, msg=repr(s)):
                validate_spec(s)

    def test_device_count(self) -> None:
        self.assertEqual(len(devices(spec())), 0)
        self.assertEqual(len(devices(spec(net=True))), 0)  # TSI: no NIC
        self.assertEqual(len(devices(spec(net=True, net_backend="virtio-net"))), 1)
        self.assertEqual(len(devices(spec(ports=[PortMapping(1, 2), PortMapping(3, 4)]))), 1)
        self.assertEqual(len(devices(spec(outbound_localhost_only=True))), 1)
        self.assertEqual(len(devices(spec(allow_hosts=["a.b"]))), 1)
        self.assertEqual(len(devices(spec(allow_cidrs=["1.2.3.4"]))), 1)
        for img in ("/i", "./i", "../i", "i.tar", "i.tar.gz", "i.tgz"):
            self.assertEqual(len(devices(spec(image=img))), 1, img)
        self.assertEqual(len(devices(spec(image="docker.io/alpine:3"))), 0)
        self.assertEqual(len(devices(spec(from_file="/x.smolmachine"))), 1)
        self.assertEqual(len(devices(spec(volumes=self.vols(3)))), 3)
        self.assertEqual(len(devices(spec(mount_sockets=[MountSocket("/a", "/b")] * 3))), 0)

    def test_budget(self) -> None:
        validate_spec(spec(volumes=self.vols(3), ports=[PortMapping(1, 2)]))
        validate_spec(spec(volumes=self.vols(4)))
        for s in (
            spec(volumes=self.vols(4), ports=[PortMapping(1, 2)]),
            spec(volumes=self.vols(4), outbound_localhost_only=True),
            spec(volumes=self.vols(3), ports=[PortMapping(1, 2)], image="./rootfs"),
            spec(volumes=self.vols(5)),
        ):
            with self.assertRaises(DeviceBudgetExceeded) as cm:
                validate_spec(s)
            self.assertEqual(cm.exception.code, "DEVICE_BUDGET")
            self.assertIn("budget is 4", cm.exception.message)
        validate_spec(spec(volumes=self.vols(5), ports=[PortMapping(1, 2)]), device_budget=6)


class ArgvTests(SynchronousTestCase):
    def test_minimal(self) -> None:
        self.assertEqual(create_args(spec()), ["machine", "create", "--name", "m1"])

    def test_every_flag(self) -> None:
        s = MachineSpec(
            name="side-1",
            labels={"owner": "bottlenet", "bottle": "b1"},
            image="registry.example/sidecar:1",
            cpus=2,
            mem=1024,
            volumes=[Volume("/h1", "/g1", True), Volume("/h2", "/g2")],
            ports=[PortMapping(40001, 3128), PortMapping(40002, 8080)],
            env={"A": "1", "B": "x=y"},
            workdir="/work",
            net=True,
            net_backend="virtio-net",
            allow_cidrs=["10.1.0.0/16"],
            allow_hosts=["api.example.com"],
            outbound_localhost_only=True,
            mount_sockets=[MountSocket("/run/b/egress.sock", "/run/egress.sock")],
            workload=["/bin/serve", "--port", "3128"],
        )
        self.assertEqual(
            create_args(s),
            [
                "machine", "create", "--name", "side-1",
                "--label", "owner=bottlenet", "--label", "bottle=b1",
                "--image", "registry.example/sidecar:1",
                "--cpus", "2", "--mem", "1024",
                "--volume", "/h1:/g1:ro", "--volume", "/h2:/g2",
                "--port", "40001:3128", "--port", "40002:8080",
                "--env", "A=1", "--env", "B=x=y",
                "--workdir", "/work",
                "--net", "--net-backend", "virtio-net",
                "--allow-cidr", "10.1.0.0/16", "--allow-host", "api.example.com",
                "--outbound-localhost-only",
                "--mount-socket", "/run/b/egress.sock:/run/egress.sock",
                "--", "/bin/serve", "--port", "3128",
            ],
        )  # fmt: skip

    def test_from_file(self) -> None:
        self.assertEqual(
            create_args(spec(from_file="/p/x.smolmachine"))[-2:], ["--from", "/p/x.smolmachine"]
        )

    def test_exec(self) -> None:
        self.assertEqual(
            exec_args("m1", ["sh", "-c", "echo"], {"K": "v"}, "/w", interactive=True),
            ["machine", "exec", "--name", "m1", "-e", "K=v", "-w", "/w", "-i", "--",
             "sh", "-c", "echo"],
        )  # fmt: skip
        self.assertEqual(exec_args("m1", ["-rf"]), ["machine", "exec", "--name", "m1", "--", "-rf"])
        self.assertRaises(InvalidArgument, exec_args, "m1", [])
        self.assertRaises(InvalidArgument, exec_args, "-m1", ["x"])
        self.assertRaises(InvalidArgument, exec_args, "m1", ["x"], {"B AD": "v"})
        self.assertRaises(InvalidArgument, exec_args, "m1", ["x\0"])

    def test_exec_detached(self) -> None:
        self.assertEqual(
            exec_args("m1", ["run"], detach=True),
            ["machine", "exec", "--name", "m1", "-d", "--", "run"],
        )
        self.assertRaises(InvalidArgument, exec_args, "m1", ["x"], interactive=True, detach=True)


class SmolvmRulesTests(SynchronousTestCase):
    """Refusals vmctl makes itself, mirroring (or stricter than) the real 1.32.2 CLI."""

    def test_refused_before_spawning(self) -> None:
        from vmctl.spec import ExposeSocket, MountSocket, exec_args

        tmp = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, tmp)
        bad = [
            MachineSpec("m", volumes=[Volume("/etc", "/x")]),
            MachineSpec("m", volumes=[Volume("/usr/lib", "/x")]),
            MachineSpec("m", net=True, net_backend="tsi", allow_cidrs=["10.0.0.1/32"]),
            MachineSpec("m", net=True, net_backend="tsi", ports=[PortMapping(5, 6)]),
            MachineSpec("m", net_backend="virtio-net"),
            MachineSpec("m", mount_sockets=[MountSocket("/a", "/r/x"), MountSocket("/b", "/r/x")]),
            MachineSpec("m", expose_sockets=[ExposeSocket("/r/x", "/h"), ExposeSocket("/r", "/h")]),
            MachineSpec("m", user="bad user"),
        ]  # fmt: skip
        for spec in bad:
            with self.assertRaises(InvalidArgument, msg=repr(spec)):
                validate_spec(spec, check_paths=False)
        for guest, host in (("run/x", "/h/a"), ("/run/x", "rel/a"), ("/run/x;y", "/h/a")):
            with self.assertRaises(InvalidArgument):
                ExposeSocket(guest, host)
        validate_spec(MachineSpec("m", volumes=[Volume(tmp, "/x")], user="1000:1000"))
        with self.assertRaises(InvalidArgument):
            exec_args("m", ["x"], detach=True, guest_timeout=5)  # would kill the workload
        self.assertEqual(
            exec_args("m", ["x"], user="app", guest_timeout=3)[-6:],
            ["--user", "app", "--timeout", "3s", "--", "x"],
        )
