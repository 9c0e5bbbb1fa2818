"""What a refusal shows a person: their own odd words as typed (escaped), and the ``--spec``
file a spec key's refusal is about (newcomer-3 traps 13 and 14), against a real daemon."""

from __future__ import annotations

import io
import os
from typing import Any

from twisted.internet.threads import deferToThread

from bottlenet.cli.main import in_spec_file, main
from bottlenet.cli.output import own_words
from bottlenet.errors import InvalidArgument, safe_repr
from tests.bottles.harness import DaemonCase


def test_own_words_replaces_only_the_digest_of_a_typed_word() -> None:
    """A digest of a typed word becomes the word, escaped; other digests stay digests."""
    message = f"bottle name {safe_repr('ümlaut')} is invalid; {safe_repr('not typed')}"
    shown = own_words(message, ["bottle", "create", "ümlaut"])
    assert shown == f"bottle name '\\xfcmlaut' is invalid; {safe_repr('not typed')}"
    assert own_words("plain 'web1' message", ["web1"]) == "plain 'web1' message"


def test_in_spec_file_names_the_file_only_for_a_spec_key() -> None:
    """A refusal that starts with one of the spec's own keys names the file; another does not."""
    spec = '{"mode": "sockets", "agent": {"image": "x"}}'
    for message in ("mode: must be one of", "agent.image: no such file", "agent[0]: odd"):
        e = in_spec_file(InvalidArgument(message), "/s.toml", spec)
        assert e.message == f"--spec /s.toml: {message}"
    other = InvalidArgument("bottle name 'X' is invalid")
    assert in_spec_file(other, "/s.toml", spec) is other
    assert in_spec_file(other, None, None) is other


class RefusalTests(DaemonCase):
    def ctl(self, *argv: str) -> Any:
        def run() -> tuple[int, str]:
            err = io.StringIO()
            code = main(["--control", self.control, *argv], env={}, err=err)
            return code, err.getvalue()

        return deferToThread(run)

    async def test_an_odd_name_is_shown_as_typed_and_a_spec_error_names_its_file(self) -> None:
        """``bottle create 'demo demo'`` shows that name, escaped, not a digest; a bad spec key
        names the file the person must fix."""
        await self.start()
        code, err = await self.ctl("bottle", "create", "demo demo")
        assert code == 1 and "bottle name 'demo demo' is invalid" in err, err
        code, err = await self.ctl("bottle", "create", "ümlaut")
        assert code == 1 and "bottle name '\\xfcmlaut' is invalid" in err, err
        spec = os.path.join(self.tmp, "bad.toml")
        with open(spec, "w") as f:
            f.write('mode = "sockets"\n')
        code, err = await self.ctl("bottle", "create", "x", "--spec", spec)
        assert code == 1 and err.startswith(f"error: INVALID_ARGUMENT: --spec {spec}: mode: "), err
