"""`--help` for commands that carry the 30-odd engine flags, as vLLM's `serve --help` does:
the command's own flags in full, each engine section in one line of flag names, and
`--help=SECTION`, `--help=all` or `--help=WORD` (flags whose name or help mention it) for
the details, so `tokenmill eval --help` is a page rather than 185 lines."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

from tokenmill.entrypoints.engine_args import ENGINE_SECTIONS

ALL = "all"


def add_sectioned_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` (made with `add_help=False`) a `-h/--help [SECTION]` flag."""
    parser.add_argument(
        "-h",
        "--help",
        nargs="?",
        const=None,
        default=argparse.SUPPRESS,
        metavar="SECTION",
        action=SectionedHelpAction,
        help=f"show this help; --help=SECTION the flags of one engine section "
        f"({', '.join(ENGINE_SECTIONS)}), --help=all every flag, --help=WORD the flags "
        "that mention WORD",
    )


class SectionedHelpAction(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> NoReturn:
        sys.stdout.write(sectioned_help(parser, values if isinstance(values, str) else None))
        parser.exit()


class Section(NamedTuple):
    """An argument group's title, description and flags (or some of them)."""

    title: str
    description: str | None
    actions: list[argparse.Action]


def sectioned_help(parser: argparse.ArgumentParser, section: str | None) -> str:
    if section == ALL:
        return parser.format_help()
    groups = [
        Section(g.title or "", g.description, g._group_actions)
        for g in parser._action_groups
        if g._group_actions
    ]
    engine = [g for g in groups if g.title in ENGINE_SECTIONS]
    if section is None:
        return _format(parser, [g for g in groups if g not in engine], engine_summary=engine)
    chosen = [g for g in groups if g.title == section]
    if chosen:
        return _format(parser, chosen)
    word = section.lower()
    mentioning = [
        Section(g.title, g.description, [a for a in g.actions if _mentions(a, word)])
        for g in groups
    ]
    return _format(parser, [g for g in mentioning if g.actions], word=section)


def _mentions(action: argparse.Action, word: str) -> bool:
    return (
        any(word in name for name in action.option_strings) or word in (action.help or "").lower()
    )


def _format(
    parser: argparse.ArgumentParser,
    sections: list[Section],
    *,
    engine_summary: Sequence[Section] = (),
    word: str | None = None,
) -> str:
    formatter = parser._get_formatter()
    formatter.add_usage(None, [a for s in sections for a in s.actions], [])
    formatter.add_text(parser.description)
    if word is not None and not sections:
        formatter.add_text(f"no flag mentions {word!r}; sections: {', '.join(ENGINE_SECTIONS)}")
    for section in sections:
        formatter.start_section(section.title)
        formatter.add_text(section.description)
        formatter.add_arguments(section.actions)
        formatter.end_section()
    if engine_summary:
        formatter.start_section("engine flags (--help=SECTION explains one section)")
        width = shutil.get_terminal_size().columns - 4
        lines = [
            textwrap.fill(
                f"{section.title}: " + " ".join(a.option_strings[0] for a in section.actions),
                width=max(width, 40),
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
            for section in engine_summary
        ]
        formatter.add_text("\n".join(lines))
        formatter.end_section()
    text = formatter.format_help()
    if engine_summary:
        text = text.replace(" [-h [SECTION]]", " [-h [SECTION]] [ENGINE FLAGS]", 1)
    return text
