"""Plain text of the identified paragraphs in one LibreOffice help page.

The help is shipped as generated HTML (``text/<module>/.../*.html``); the sources it is
generated from are ``.xhp`` XML files. In both, every translatable paragraph or heading
carries an ``id`` that is the same in every language, which is what makes alignment exact.
This module turns one page into ``[(id, text), ...]`` in document order, with markup stripped.

Rules, chosen so German and English render the same way:
- targets are ``p``, ``h1``..``h6`` (HTML) and ``paragraph``/``title`` (xhp) with an ``id``;
- inline markup is dropped, its text kept; ``<br>`` becomes a space;
- of a system switch (``switchinline``) only the default variant is kept: hidden HTML spans
  whose id does not start with ``default`` and xhp ``caseinline`` are skipped, so Mac-only
  menu paths do not double the text;
- ``script``, ``style``, xhp ``comment``, ``bookmark_value`` and image ``alt`` are skipped.
"""
from __future__ import annotations

import re
import unicodedata
from html.parser import HTMLParser
from typing import List, Optional, Tuple

TARGET_TAGS = frozenset({"p", "h1", "h2", "h3", "h4", "h5", "h6", "paragraph", "title"})
SKIP_TAGS = frozenset({"script", "style", "comment", "bookmark_value", "caseinline", "alt", "embedvar"})
VOID_TAGS = frozenset({"br", "img", "meta", "input", "link", "hr", "wbr", "area", "base", "col",
                       "embed", "source", "track", "param"})
_WS = re.compile(r"\s+")


_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u200b\u200c\u200d\u2060\ufeff"))


def normalize_space(text: str) -> str:
    """NFC, drop soft hyphens and zero-width characters, collapse whitespace, strip.

    Soft hyphens occur in some English pages ("Mon\u00adday") and would otherwise split
    words differently from the German side.
    """
    text = unicodedata.normalize("NFC", text).translate(_INVISIBLE)
    return _WS.sub(" ", text).strip()


class _ParagraphParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: List[Tuple[str, str]] = []
        self._cur_id: Optional[str] = None
        self._cur_tag: Optional[str] = None
        self._buf: List[str] = []
        self._stack: List[str] = []   # open tags inside the current target
        self._skip_depth = 0          # >0 while inside a skipped subtree
        self._skip_stack: List[str] = []

    # -- helpers -----------------------------------------------------------------
    def _finish(self) -> None:
        if self._cur_id is not None:
            self.out.append((self._cur_id, normalize_space("".join(self._buf))))
        self._cur_id = None
        self._cur_tag = None
        self._buf = []
        self._stack = []
        self._skip_stack = []
        self._skip_depth = 0

    @staticmethod
    def _is_skipped(tag: str, attrs: dict) -> bool:
        if tag in SKIP_TAGS:
            return True
        if tag == "span" and "hidden" in attrs:
            return not (attrs.get("id") or "").startswith("default")
        return False

    # -- HTMLParser callbacks ----------------------------------------------------
    def handle_starttag(self, tag: str, attrs_list) -> None:
        attrs = {k: (v if v is not None else "") for k, v in attrs_list}
        if self._cur_id is None:
            if tag in TARGET_TAGS and attrs.get("id"):
                self._cur_id = attrs["id"]
                self._cur_tag = tag
            return
        if tag in TARGET_TAGS and tag == self._cur_tag and not self._stack:
            # An unclosed <p> followed by another: HTML closes the first implicitly.
            self._finish()
            self.handle_starttag(tag, attrs_list)
            return
        if tag == "br":
            if not self._skip_depth:
                self._buf.append(" ")
            return
        if tag in VOID_TAGS:
            return
        if self._skip_depth:
            self._skip_stack.append(tag)
            self._skip_depth += 1
            return
        if self._is_skipped(tag, attrs):
            self._skip_stack.append(tag)
            self._skip_depth = 1
            return
        self._stack.append(tag)

    def handle_startendtag(self, tag: str, attrs_list) -> None:
        if tag == "br" and self._cur_id is not None and not self._skip_depth:
            self._buf.append(" ")
        # other self-closing tags carry no text

    def handle_endtag(self, tag: str) -> None:
        if self._cur_id is None:
            return
        if self._skip_depth:
            if tag in self._skip_stack:
                while self._skip_stack:
                    self._skip_depth -= 1
                    if self._skip_stack.pop() == tag:
                        break
                if not self._skip_stack:
                    self._skip_depth = 0
            return
        if tag in self._stack:
            while self._stack and self._stack.pop() != tag:
                pass
            return
        if tag == self._cur_tag:
            self._finish()
        elif tag in ("div", "body", "td", "li", "table", "html"):
            # A block closes around an unclosed target.
            self._finish()

    def handle_data(self, data: str) -> None:
        if self._cur_id is not None and not self._skip_depth:
            self._buf.append(data)

    def close(self) -> None:
        super().close()
        self._finish()


def extract_paragraphs(markup: str) -> List[Tuple[str, str]]:
    """Return ``[(id, plain_text), ...]`` of every identified paragraph, in document order.

    Ids may repeat within a page (embedded sections); every occurrence is returned and the
    caller pairs occurrences by their rank.
    """
    parser = _ParagraphParser()
    parser.feed(markup)
    parser.close()
    return list(parser.out)
