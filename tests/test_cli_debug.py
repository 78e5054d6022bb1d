"""Every verb made by commands/parsers.add_verb takes ``--debug`` after its name, as before it."""

from __future__ import annotations

import argparse

import pytest

from featurestore.cli import build_parser

VERBS = ("extract", "import", "export", "embed", "ls", "info", "verify", "rm", "status", "commit", "serve",
         "probe", "demo")


def _verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_verb_but_bench_has_debug() -> None:
    verbs = _verbs(build_parser())
    assert set(VERBS) <= set(verbs)
    missing = [name for name, sub in verbs.items() if name != "bench" and "--debug" not in sub._option_string_actions]
    assert missing == []


@pytest.mark.parametrize("argv", [
    ["embed", "st", "--dataset", "d", "--encoder", "uni", "--split", "all", "--slide-encoder", "mean",
     "--encoder-name", "m", "--debug"],
    ["probe", "st", "--head", "abmil", "--dataset", "d", "--encoder", "uni", "--train", "all", "--debug"],
    ["ls", "st", "--debug"], ["info", "st", "d", "uni", "all", "--debug"], ["verify", "st", "--debug"],
    ["status", "st", "d/uni/all", "--debug"], ["rm", "st", "d/uni/all", "--yes", "--debug"],
    ["serve", "st", "--debug"],
])
def test_debug_after_the_verb(argv: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(argv).debug is True
    assert parser.parse_args(["--debug", *argv[:-1]]).debug is True  # before the verb: not reset by the verb
    assert parser.parse_args(argv[:-1]).debug is False
