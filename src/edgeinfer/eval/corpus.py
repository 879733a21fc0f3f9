"""The evaluation text: held-out English prose that ships inside an installable package, or any file.

The default, `lee`, is the background corpus of Lee, Pincombe and Welsh (2005): 300 English news
articles (Australian Broadcasting Corporation, ~60k words, one article per line) that the gensim package
ships as test data (`gensim/test/test_data/lee_background.cor`; gensim is LGPL-2.1; the articles are
the ABC's, redistributed by gensim for research). We read the file from the installed package and never
import gensim itself (that would pull scipy in for nothing).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEXT = "lee"
GENSIM_REQUIREMENT = "gensim==4.4.0"


@dataclass(frozen=True)
class EvalText:
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
            f"the eval text {hint!r} ships in the {package} package: pip install {GENSIM_REQUIREMENT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed {package}; pip install {GENSIM_REQUIREMENT}")
    return path


def load_text(spec: str = DEFAULT_TEXT) -> EvalText:
    """`lee` (the default news corpus) or the path of a UTF-8 text file."""
    if spec == DEFAULT_TEXT:
        path = _package_file("gensim", "test/test_data/lee_background.cor", spec)
        name = "Lee background corpus (gensim test data)"
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"eval text {spec!r} is neither {DEFAULT_TEXT!r} nor a readable file")
        name = path.name
    documents = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not documents:
        raise ValueError(f"eval text {path} is empty")
    return EvalText(name, str(path), documents)
