"""Help text for the command line: docstrings read as plain text.

The command modules' docstrings are reStructuredText (literal markup, Sphinx
roles, ``::`` before a literal block); ``--help`` shows :func:`plain` of them,
so a terminal never prints the markup.
"""

from __future__ import annotations

import argparse
import inspect
import re

__all__ = ["FORMATTER", "first_paragraph", "plain"]

#: keeps a description's own line breaks and paragraphs (the docstring's layout)
FORMATTER = argparse.RawDescriptionHelpFormatter

_DIRECTIVE = re.compile(r"^[ \t]*\.\. .*(?:\n|$)", re.MULTILINE)  # ".. note::" and the like
_ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)?:`([^`]*)`")  # :func:`x`, :py:class:`~a.B`
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")  # `text`, `link`_
_LONE_COLONS = re.compile(r"^[ \t]*::[ \t]*\n", re.MULTILINE)  # "::" on a line of its own
_SPACED_COLONS = re.compile(r"[ \t]+::[ \t]*$", re.MULTILINE)  # "text ::" reads "text"
_END_COLONS = re.compile(r"::[ \t]*$", re.MULTILINE)  # "text::" reads "text:"


def _role_text(match: re.Match[str]) -> str:
    """A role's text as Sphinx would show it: the title of ``title <target>``,
    the last name of ``~a.b.C``, the name itself otherwise."""
    text = match.group(1)
    titled = re.fullmatch(r"(.*?)\s*<[^>]*>", text, re.DOTALL)
    if titled and titled.group(1):
        return titled.group(1)
    if text.startswith("~"):
        return text[1:].rsplit(".", 1)[-1]
    return text.lstrip(".!")


def plain(text: str | None) -> str:
    """``text`` (a docstring) as plain text: dedented, with reST's inline
    markup, roles, directives and ``::`` markers taken out."""
    out = inspect.cleandoc(text or "")
    out = _DIRECTIVE.sub("", out)
    out = _ROLE.sub(_role_text, out)
    out = _LITERAL.sub(r"\1", out)
    out = _INTERPRETED.sub(r"\1", out)
    out = _LONE_COLONS.sub("", out)
    out = _SPACED_COLONS.sub("", out)
    out = _END_COLONS.sub(":", out)
    return out.strip()


def first_paragraph(text: str | None) -> str:
    """The first paragraph of :func:`plain` of ``text``."""
    return plain(text).split("\n\n", 1)[0]
