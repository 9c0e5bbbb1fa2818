"""Packaging: the twistd plugin is found after a normal install, and the README matches CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = textwrap.dedent(
    """
    import json
    from twisted.application.service import IServiceMaker
    from twisted.plugin import getPlugins
    names = sorted(p.tapname for p in getPlugins(IServiceMaker))
    import bottlenet.tap, twisted.plugins.bottlenet_plugin as plugin
    print(json.dumps({"names": names, "plugin": plugin.__file__, "tap": bottlenet.tap.__file__}))
    """
)


def test_plugin_found_after_normal_install(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # -I: isolated mode, so neither the checkout nor PYTHONPATH is on sys.path; only what
    # `pip install .` put into site-packages can be found.
    out = subprocess.run(
        [sys.executable, "-I", "-c", PROBE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "bottlenet" in result["names"]
    checkout_sources = (os.path.join(ROOT, "twisted") + os.sep, os.path.join(ROOT, "bottlenet"))
    for key in ("plugin", "tap"):
        assert "site-packages" in result[key] and not result[key].startswith(checkout_sources), (
            f"{key} was imported from the checkout, not from a normal install: "
            "run the README's test command (pip install '.[dev,vm]'), not an editable install"
        )


def test_reactor_plugin_found_after_normal_install(tmp_path) -> None:  # type: ignore[no-untyped-def]
    probe = (
        "from twisted.application.reactors import getReactorTypes\n"
        "print(sorted(r.shortName for r in getReactorTypes()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'bottlenet-epoll'" in out.stdout


def test_no_init_in_twisted_plugins() -> None:
    # An __init__.py here would shadow Twisted's own twisted/plugins package.
    assert not os.path.exists(os.path.join(ROOT, "twisted", "__init__.py"))
    assert not os.path.exists(os.path.join(ROOT, "twisted", "plugins", "__init__.py"))


def test_plugin_module_is_lazy() -> None:
    # The plugin file must not import the daemon: twistd imports every plugin to list them.
    with open(os.path.join(ROOT, "twisted", "plugins", "bottlenet_plugin.py")) as f:
        source = f.read()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert imports == [
        "from __future__ import annotations",
        "from twisted.application.service import ServiceMaker",
    ]


def _readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    start = lines.index("```sh") + 1
    end = lines.index("```", start)
    return lines[start:end]


def test_readme_opens_with_two_commands_and_ci_runs_the_test_one() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    run, test = commands
    assert "twist bottlenet" in run and "examples/demo.toml" in run
    assert "pytest" in test
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().splitlines()
    assert test in ci


def test_every_package_of_the_tree_is_shipped() -> None:
    """Every package directory under bottlenet/ and vmctl/ is in the wheel's package list."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("bottlenet", "vmctl"):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert found - listed == set()
