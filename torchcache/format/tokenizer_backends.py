"""Tokenizers other than a Hugging Face tokenizer.json (tiktoken, SentencePiece): what every
backend gives the builder and the reader, the files a cache keeps of one, and loading a cache's
copy back, refused unless each file is the one the cache was built with.

A backend is defined by its files alone (name -> bytes): the cache stores them beside the
manifest, build workers rebuild the backend from them, and the spec records each file's sha256
and a fingerprint over them. A Hugging Face tokenizer keeps its own path (format.tokenizer) and
its spec stays as it was: only these backends add a "kind" to ``spec["tokenizer"]``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import CacheFormatError

#: kind -> (extra that installs its library, the library's import name)
#: kind -> the names of the files a cache keeps of it (at its top, beside the manifest)
FILE_NAMES = {"tiktoken": ("tokenizer.tiktoken", "tokenizer.tiktoken.json"),
              "sentencepiece": ("tokenizer.model",)}
EXTRAS = {"tiktoken": ("tiktoken", "tiktoken"), "sentencepiece": ("sentencepiece", "sentencepiece")}

# Candidate cuts of a long text, most preferred first (each is still proven before it is made):
# between the two newlines of a blank line (GPT-2's regex splits there), and after a blank line
# before a letter (cl100k-style patterns keep a newline run whole; SentencePiece folds
# whitespace into the next piece).
CUT_CANDIDATES = (re.compile(r"(?<=\n)(?=\n\S)"), re.compile(r"(?<=\n\n)(?=[^\W\d_])"))


def read_tokenizer_file(path: str, what: str) -> bytes:
    """The bytes of a tokenizer's own file (FileNotFoundError naming it as `what`)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None


def require_library(kind: str) -> Any:
    """The backend's library, imported now; an ImportError of one line naming the extra if it
    is missing."""
    extra, module = EXTRAS[kind]
    try:
        return __import__(module)
    except ImportError as error:
        raise ImportError(f"{kind} tokenizers need the {module} package: pip install "
                          f"'torchcache-lm[{extra}]' (or pip install {module})") from error


class TokenizerBackend:
    """A tokenizer the cache stores as its own files (subclasses: tiktoken, SentencePiece).

    Subclasses set `kind` and `files`, and implement the encoding and decoding methods; ids are
    exactly the backend library's own encode of the text.
    """

    kind: str = ""
    files: dict[str, bytes]

    # ------------------------------------------------------------ identity
    @property
    def file_hashes(self) -> dict[str, str]:
        """Each stored file's sha256 (what the spec records, so a swapped file is named)."""
        return {name: "sha256:" + hashlib.sha256(data).hexdigest()
                for name, data in sorted(self.files.items())}

    @property
    def fingerprint(self) -> str:
        return backend_fingerprint(self.kind, self.file_hashes)

    def spec(self) -> dict[str, Any]:
        """The cache spec's "tokenizer" entry."""
        return {"kind": self.kind, "fingerprint": self.fingerprint, "files": self.file_hashes}

    def payload(self) -> tuple[str, tuple[tuple[str, bytes], ...]]:
        """What travels to build workers: (kind, files), rebuilt there by :func:`backend_from_files`."""
        return self.kind, tuple(sorted(self.files.items()))

    # ------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def special_tokens(self) -> dict[str, int]:
        """Special (control) tokens, content -> id."""
        raise NotImplementedError

    # ------------------------------------------------------------ encoding
    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special-token strings in it taken as text (the library's own
        plain encode)."""
        return self.encode_batch([text], special_tokens_as_text=True)[0].tolist()

    def encode_batch(self, texts: Sequence[str], special_tokens_as_text: bool) -> list[np.ndarray]:
        """Each text's ids (an integer array each; no BOS/EOS)."""
        raise NotImplementedError

    def encode_offsets_batch(self, texts: Sequence[str], special_tokens_as_text: bool
                             ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each text's ids and their (start, end) character offsets in the text."""
        raise NotImplementedError

    def token_byte_lengths(self) -> np.ndarray | None:
        """Each id's UTF-8 byte length when the tokens' bytes always add up to the text's (a
        byte-level BPE); None when offsets must come from the library."""
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------ long texts
    def cut_candidates(self) -> Sequence[re.Pattern[str]]:
        """Patterns of candidate cuts of long texts, most preferred first (each is proven)."""
        return CUT_CANDIDATES

    @property
    def check_chars(self) -> int:
        """Characters on each side of a candidate cut that are encoded to prove it."""
        longest = max((len(t) for t in self.special_tokens()), default=0)
        return max(64, 2 * longest + 2)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} vocab_size={self.vocab_size} {self.fingerprint[:19]}…>"


def backend_fingerprint(kind: str, hashes: Mapping[str, str]) -> str:
    """The fingerprint of a backend from its kind and its files' sha256."""
    canonical = json.dumps({"kind": kind, "files": dict(sorted(hashes.items()))},
                           sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def stored_file_names(spec_tokenizer: dict[str, Any]) -> list[str]:
    """The files a cache keeps of its tokenizer, from the spec's "tokenizer" entry (new kinds)."""
    kind, files = spec_tokenizer.get("kind"), spec_tokenizer.get("files")
    if not isinstance(files, dict) or not files or set(files) - set(FILE_NAMES.get(kind, ())):
        raise CacheFormatError(f"spec.tokenizer of kind {kind!r} names files {files!r}, not "
                               f"{list(FILE_NAMES.get(kind, ()))}; the manifest is damaged, or "
                               "was written by a newer torchcache")
    return sorted(files)


def check_backend_files(spec_tokenizer: dict[str, Any], files: Mapping[str, bytes],
                        where: Callable[[str], str]) -> None:
    """A CacheFormatError naming the first stored file (`where(name)`: its path) that is not the
    one the cache was built with (its sha256 is not the spec's)."""
    expected = spec_tokenizer["files"]
    for name in sorted(expected):
        found = "sha256:" + hashlib.sha256(files[name]).hexdigest()
        if found != expected[name]:
            raise CacheFormatError(f"{where(name)}: not the {spec_tokenizer['kind']} tokenizer file "
                                   f"the cache was built with: its sha256 is {found}, the "
                                   f"manifest's spec says {expected[name]} (it would decode the "
                                   f"cache's token ids to other text); restore the {name} the "
                                   "cache was built with")
    if backend_fingerprint(spec_tokenizer["kind"], expected) != spec_tokenizer["fingerprint"]:
        raise CacheFormatError(f"{where(sorted(expected)[0])}: spec.tokenizer's fingerprint does "
                               "not match its files' hashes; the manifest is damaged")
