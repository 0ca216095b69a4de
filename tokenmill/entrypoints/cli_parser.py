"""The argument parser every `tokenmill` command uses: help that shows defaults, and an unknown
flag reported with the usage of the (sub)command it was given to."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help, except where there is nothing to say: no
    default (None), an on/off switch that is off by default, or a help text that already
    says what the default is (which also keeps a secret read from the environment, such as
    --api-key's, out of the help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if action.default is None or switch or "(default" in help_text:
            return help_text
        return super()._get_help_string(action) or help_text


class CommandParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose subcommands (made with this class too) reject unknown flags
    themselves, so the error shows `tokenmill serve`'s usage rather than `tokenmill`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return namespace, unknown
