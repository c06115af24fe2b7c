"""The forecast's command line: jsonargparse's errors turned into one line naming the nearest valid options."""

import re
import sys
from dataclasses import fields

from src.scaling.hardware import did_you_mean


def group(cls: type, options: dict) -> object:
    """An instance of the dataclass `cls` from the parsed `options`, each field by its own name."""
    return cls(**{f.name: options[f.name] for f in fields(cls)})


def not_a_choice(text: str) -> str | None:
    """"--optimizer 'lamb' is not one of sgd, sgd_momentum, adam, adamw" for jsonargparse's message about a value
    that an option with choices does not take; None for any other message."""
    key = re.search(r'Parser key "(\w+)"', text)
    choices = re.search(r"Expected a typing\.Literal\[([^\]]*)\]", text)
    value = re.search(r"Given value: (\S+)|Got value: (\S+)", text)
    if not (key and choices and value):
        return None
    names = [c.strip().strip("'\"") for c in choices.group(1).split(",")]
    given = (value.group(1) or value.group(2)).strip("'\"")
    return f"--{key.group(1)} {given!r} is not one of {', '.join(names)}{did_you_mean(given, names)}"


def parse_options(parser: object, args: list[str]) -> dict:
    """`parser.parse_args(args)` as a dict; a bad option ends in one line naming the nearest valid ones.

    Raises:
        SystemExit: Code 2 after the line on stderr.
    """
    from jsonargparse import ArgumentError

    try:
        return parser.parse_args(args).as_dict()
    except ArgumentError as err:
        unknown = re.search(r"unrecognized arguments: --([\w-]+)", str(err))
        options = [f"--{a.dest}" for a in parser._actions if a.dest not in ("help", "config")]
        hint = did_you_mean(f"--{unknown.group(1).replace('-', '_')}", options) if unknown else ""
        text = not_a_choice(str(err)) or " ".join(str(err).split())
        print(f"python -m src.forecast: error: {text}{hint} (--help lists every option)", file=sys.stderr)
        raise SystemExit(2) from None
