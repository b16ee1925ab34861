"""The command table of the `trimtab` CLI: a subcommand is its handler with `@command(NAME, HELP,
*ARGS)` above it (cli.py), each ARG one `add_argument` call's flags and keywords, collected in
COMMANDS in declaration order; cli.build_parser turns them into the argparse parser."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Arg = tuple[tuple[str, ...], dict[str, Any]]  # one add_argument call: flags (or positional name), keywords
Handler = Callable[[argparse.Namespace], int]


def arg(*flags: str, **kw: Any) -> Arg:
    return flags, kw


def number(kind: type, low: float, high: float | None = None, above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a `kind` (int or float) at least `low` (above it when `above`) and at most
    `high`; argparse's error names the flag, as for a word that is no number."""

    def parse(text: str) -> Any:
        value = kind(text)
        odd = value != value or value in (math.inf, -math.inf)  # nan compares as neither; no count is infinite
        if odd or value < low or (above and value == low) or (high is not None and value > high):
            span = f"{'above' if above else 'at least'} {low:g}" + (
                f" and at most {high:g}" if high is not None else ""
            )
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if odd else ''}{span}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


class OneOf:
    """Arguments that exclude each other (an argparse mutually exclusive group)."""

    def __init__(self, *args: Arg) -> None:
        self.args = args


@dataclass(frozen=True)
class Command:
    name: str  # "data prepare": `prepare` under the group `data` (GROUPS)
    func: Handler
    help: str
    args: tuple[Arg | OneOf, ...]
    description: str | None = None
    epilog: str | None = None
    raw: bool = False  # description and epilog printed as written (line breaks kept)


COMMANDS: list[Command] = []  # in `trimtab --help`'s order: the order of cli_train.py's and cli.py's handlers


def command(name: str, help: str, *args: Arg | OneOf, **parser: Any) -> Callable[[Handler], Handler]:
    """Declare the decorated handler as subcommand `name` taking `args` (`parser`: description, epilog, raw)."""

    def declare(func: Handler) -> Handler:
        COMMANDS.append(Command(name, func, help, args, **parser))
        return func

    return declare


def add_args(parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, args: tuple) -> None:
    """Each Arg an add_argument call on parser; each OneOf a mutually exclusive group."""
    for a in args:
        if isinstance(a, OneOf):
            add_args(parser.add_mutually_exclusive_group(), a.args)
        else:
            flags, kw = a
            parser.add_argument(*flags, **kw)
