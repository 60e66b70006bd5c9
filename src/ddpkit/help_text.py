"""Help text for a terminal: the reStructuredText and Markdown markup that docstrings and
torch's own option help carry, turned into plain words.

``ddpkit``'s parsers and torchrun's (``ddpkit launch``) both print through this, so no
``--help`` shows backticks or roles a reader would have to decode.
"""

from __future__ import annotations

import re

# A reST literal (two backticks) or a role (:func:`name`, :class:`~pkg.Name`) becomes the
# bare name; a Markdown code span (one backtick) keeps its edges as plain quotes, since
# it usually marks a whole command inside a sentence.
_MARKUP = re.compile(
    r"``([^`]+?)``"
    r"|:(?:class|func|mod|meth|data|attr|exc|obj):`~?([^`]+)`"
    r"|`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without markup: ``code`` and :mod:`name` bare, `code` quoted."""
    def replace(match: re.Match) -> str:
        literal, role, span = match.groups()
        return literal or role or f"'{span}'"

    return _MARKUP.sub(replace, text)
