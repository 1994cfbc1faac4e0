"""HTML as LibreTranslate's `format=html` translates it: the text between tags is translated, one text
at a time; the tags with their attributes, comments, declarations, and the insides of script and style
are kept as they were written. A translation goes back entity-escaped (`<`, `>`, `&`), so a text never
becomes markup. Plain functions over strings (the standard library's HTMLParser).

An inline tag cuts a sentence in texts the translator sees apart: "Where is the <b>station</b>? It is
far." gives "? It is far.", whose "?" ends the sentence before the tag. The translator keeps only what
its clauses hold (kinds/text.py drops a lone terminator), so that punctuation, and a text of nothing
but punctuation, would be lost: each text's leading closing punctuation and trailing opening brackets,
with the white space around them, are kept as written, and a text without a word is not translated."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from html import escape
from html.parser import HTMLParser

# their insides are code, not text: what the parser passes raw (script, style; newer Pythons more)
KEPT_AS_WRITTEN = HTMLParser.CDATA_CONTENT_ELEMENTS
# What closes the sentence or clause begun before a tag (text.py's terminators, closing brackets and
# quotes: not ' or ", which open as often) and what opens one after it: kept around a translated text.
LEAD = re.compile(r"[\s.!?…,;:”»)\]]*")
OPENING = "([“‘«"


@dataclass(frozen=True, slots=True)
class Part:
    raw: str  # markup as written, or a text as read (its entities decoded)
    text: bool  # a text between tags, to translate


class _Splitter(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[Part] = []
        self.inside_code = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.parts.append(Part(self.get_starttag_text() or "", False))
        self.inside_code += tag in KEPT_AS_WRITTEN

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.parts.append(Part(self.get_starttag_text() or "", False))

    def handle_endtag(self, tag: str) -> None:
        self.parts.append(Part(f"</{tag}>", False))
        self.inside_code = max(0, self.inside_code - (tag in KEPT_AS_WRITTEN))

    def handle_data(self, data: str) -> None:
        text = not self.inside_code  # a script's insides come raw: kept so
        if text and self.parts and self.parts[-1].text:
            # the parser gives a bare "<" ("x < 5") as a text of its own: the sentence stays one text
            self.parts[-1] = Part(self.parts[-1].raw + data, text)
        else:
            self.parts.append(Part(data, text))

    def handle_comment(self, data: str) -> None:
        self.parts.append(Part(f"<!--{data}-->", False))

    def handle_decl(self, decl: str) -> None:
        self.parts.append(Part(f"<!{decl}>", False))

    def handle_pi(self, data: str) -> None:
        self.parts.append(Part(f"<?{data}>", False))

    def unknown_decl(self, data: str) -> None:
        self.parts.append(Part(f"<![{data}]>", False))


def parts(document: str) -> list[Part]:
    """A document's markup and texts, in order."""
    splitter = _Splitter()
    splitter.feed(document)
    splitter.close()
    return splitter.parts


def split(text: str) -> tuple[str, str, str]:
    """A text as (kept before, to translate, kept after); all of it kept where it holds no word."""
    start = LEAD.match(text).end()  # type: ignore[union-attr]  # it matches the empty string too
    if not any(c.isalnum() for c in text[start:]):
        return text, "", ""
    end = len(text)
    while text[end - 1].isspace() or text[end - 1] in OPENING:  # a word is left: it stops there
        end -= 1
    return text[:start], text[start:end], text[end:]


async def translated(document: str, translate: Callable[[str], Awaitable[str]]) -> str:
    """The document with each text that holds a word translated (what split keeps kept), each text
    entity-escaped (one read as "&lt;!--" stays text)."""
    read = parts(document)
    pieces = [split(p.raw) if p.text else None for p in read]
    done = iter(await asyncio.gather(*(translate(p[1]) for p in pieces if p and p[1])))
    out = []
    for part, piece in zip(read, pieces):
        if piece is None:
            out.append(part.raw)
        else:
            lead, core, trail = piece
            out.append(escape(lead + (next(done) if core else "") + trail, quote=False))
    return "".join(out)
