"""HTML as LibreTranslate's `format=html` translates it: the text between tags is translated, one text
at a time; the tags with their attributes, comments, declarations, and the insides of script and style
are kept as they were written. A translation goes back entity-escaped (`<`, `>`, `&`), so a text never
becomes markup. Plain functions over strings (the standard library's HTMLParser)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from html import escape
from html.parser import HTMLParser

KEPT_AS_WRITTEN = ("script", "style")  # their insides are code, not text


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
        self.parts.append(Part(data, not self.inside_code))  # a script's insides come raw: kept so

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


async def translated(document: str, translate: Callable[[str], Awaitable[str]]) -> str:
    """The document with each text that holds a word translated (its white space around kept)."""
    found = parts(document)
    wanted = [p.raw.strip() for p in found if p.text and p.raw.strip()]
    done = iter(await asyncio.gather(*(translate(text) for text in wanted)))
    out = []
    for part in found:
        if not part.text:
            out.append(part.raw)
        elif not part.raw.strip():
            out.append(part.raw)
        else:
            lead = part.raw[: len(part.raw) - len(part.raw.lstrip())]
            trail = part.raw[len(part.raw.rstrip()) :]
            out.append(lead + escape(next(done), quote=False) + trail)
    return "".join(out)
