"""Named English texts that ship inside an installable package, or any UTF-8 file: what `edgeinfer eval`
scores and what GPTQ calibrates on (engine/quant/calibrate.py); a room of its own, so quantization
imports nothing of eval.

`lee`, the eval text's default, is the background corpus of Lee, Pincombe and Welsh (2005): 300 English news
articles (Australian Broadcasting Corporation, ~60k words, one article per line) that the gensim package
ships as test data (`gensim/test/test_data/lee_background.cor`; gensim is LGPL-2.1; the articles are
the ABC's, redistributed by gensim for research). We read the file from the installed package and never
import gensim itself (that would pull scipy in for nothing).

`enwiki`, from the same test data, is a 2017 extract of English Wikipedia (the first ~200 articles, from
"Anarchism" on; CC BY-SA) with the wiki markup stripped here: GPTQ's calibration text (quant/gptq.py),
large (~380k words of prose) and unrelated to the news it is evaluated on.
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

NEWS_TEXT = "lee"
WIKI_TEXT = "enwiki"
_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_REQUIREMENT = "gensim==4.4.0"


@dataclass(frozen=True)
class Corpus:
    """A named text split into documents (non-empty lines)."""

    name: str
    source: str  # where it was read from
    documents: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.documents)


def _package_file(package: str, relative: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the text {hint!r} ships in the {package} package: pip install {GENSIM_REQUIREMENT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed {package}; pip install {GENSIM_REQUIREMENT}")
    return path


def load_text(spec: str) -> Corpus:
    """`lee` (the news corpus), `enwiki` (Wikipedia prose) or the path of a UTF-8 text file."""
    if spec == NEWS_TEXT:
        path = _package_file("gensim", "test/test_data/lee_background.cor", spec)
        name = "Lee background corpus (gensim test data)"
        content = path.read_text(encoding="utf-8")
    elif spec == WIKI_TEXT:
        path = _package_file("gensim", _WIKI_FILE, spec)
        name = "English Wikipedia extract (gensim test data)"
        content = wiki_prose(bz2.decompress(path.read_bytes()).decode("utf-8"))
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"text {spec!r} is neither {NEWS_TEXT!r}, {WIKI_TEXT!r} nor a readable file")
        name = path.name
        content = path.read_text(encoding="utf-8")
    documents = [line.strip() for line in content.splitlines() if line.strip()]
    if not documents:
        raise ValueError(f"text {path} is empty")
    return Corpus(name, str(path), documents)


_MARKUP = (
    (re.compile(r"<ref[^>]*/>|<ref.*?</ref>|<!--.*?-->", re.S), ""),  # citations, comments
    (re.compile(r"<[^>]+>"), ""),  # other tags
    (re.compile(r"\{\{[^{}]*\}\}"), ""),  # templates (innermost first; applied repeatedly)
    (re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]"), r"\1"),  # [[target|label]] -> label
    (re.compile(r"\[https?://\S+ ([^\]]*)\]"), r"\1"),  # [url label] -> label
    (re.compile(r"'{2,}"), ""),  # bold, italics
)
_PROSE_MIN_CHARS = 200  # shorter lines are headings, list items, infobox and table rows
_NOT_PROSE = ("|", "!", "{", "}", "*", "=", "[", "#", ":")  # table, template, list, heading, indent lines


def wiki_prose(xml: str) -> str:
    """The paragraphs of running text in a MediaWiki XML dump, markup removed, one per line."""
    text = html.unescape(xml)
    for pattern, repl in _MARKUP:
        for _ in range(3):  # nested templates and links unwrap one level per pass
            text, n = pattern.subn(repl, text)
            if not n:
                break
    lines = (line.strip() for line in text.splitlines())
    prose = (line for line in lines if len(line) >= _PROSE_MIN_CHARS and not line.startswith(_NOT_PROSE))
    return "\n".join(prose)
