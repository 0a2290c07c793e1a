"""gpudctl builds only the sub-parser of the command it runs (start-up time), yet every command
line parses as with the full parser, and help and errors still list every command."""

from __future__ import annotations

import pytest

from gpud.cli.arguments import COMMANDS, build_parser
from tests.support.present import present

LINES = [
    ["status"], ["status", "3", "--json"], ["--socket", "/tmp/s", "status", "--fresh"],
    ["--socket=/tmp/s", "check", "-", "--all-layouts"], ["plan", "f.yaml"], ["apply", "--wait", "--timeout", "5"],
    ["events", "-f"], ["version"], ["mig", "profiles", "--gpu", "0"], ["vgpu", "types", "--gpu", "1"], ["passthrough", "--json"], ["labels"],
    ["reload"],
]


@pytest.mark.parametrize("argv", LINES, ids=" ".join)
def test_scoped_parser_parses_as_the_full_one(argv):
    full = vars(build_parser().parse_args(argv))
    scoped = vars(build_parser(argv).parse_args(argv))
    assert scoped == full


def test_scoped_parser_holds_only_the_named_command():
    sub = next(a for a in build_parser(["--socket", "status", "version"])._actions if a.dest == "command")
    assert list(present(sub.choices)) == ["version"]  # "status" there is --socket's value, not the command


@pytest.mark.parametrize("argv", [["--help"], ["-h", "status"], ["bogus"]])
def test_help_and_errors_list_every_command(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    for name in COMMANDS:
        assert name in text
