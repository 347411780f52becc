"""WebDataset shards: reading a tar stream as samples, strictly, and decoding token-id members.

A webdataset shard is a tar whose members are grouped into samples by key: the member path up to
the first dot of its file name (`shard/000123.txt.gz` has key `shard/000123`, extension
`txt.gz`). Reading is strict: a shard that ends without the tar end-of-archive marker (cut at a
member boundary, or inside a header) is an error, never a shorter shard.

A pipeline reads each sample whole, as webdataset's own reader hands it over (`sample_record`):
`{"__key__": key, "__url__": shard, extension: bytes, ...}`.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from typing import IO, Iterator

import numpy as np
from safetensors.numpy import load as load_safetensors

TOKEN_EXTENSIONS = ("npy", "safetensors", "json", "ids.json")


def split_member(name: str) -> tuple[str, str]:
    """(key, extension) of a tar member, by webdataset's rule."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext if dot else ""


def parse_member_spec(spec: str) -> tuple[str, str | None]:
    """`"txt"` -> ("txt", None); `"json:text"` -> ("json", "text"): member extension, JSON field."""
    ext, _, field = spec.partition(":")
    if not ext:
        raise ValueError(f"text_key={spec!r}: name a member extension, e.g. 'txt', 'txt.gz', "
                         "'json:text' or (pre-tokenized) 'npy'")
    return ext.lower(), field or None


@dataclass(frozen=True)
class Sample:
    """Consecutive tar members sharing a key: (member name, bytes) in tar order."""

    key: str
    files: tuple[tuple[str, bytes], ...]

    def members(self) -> dict[str, bytes]:
        """The members by lower-case extension (a later member wins a repeated extension)."""
        return {split_member(name)[1].lower(): data for name, data in self.files}

    @property
    def last_name(self) -> str:
        return self.files[-1][0]


def sample_record(sample: Sample, url: str) -> dict[str, str | bytes]:
    """The sample (read with `iter_samples(..., bare=False)`, as webdataset reads) as webdataset's
    reader makes it: "__key__", "__url__" and each member's bytes by its lower-case extension.

    Raises ValueError naming the member when two members give the same extension (webdataset
    refuses such a sample too).
    """
    record: dict[str, str | bytes] = {"__key__": sample.key, "__url__": url}
    first: dict[str, str] = {}
    for name, data in sample.files:
        ext = split_member(name)[1].lower()
        if ext in first:
            raise ValueError(f"member {name!r} gives extension {ext!r} twice (after member "
                             f"{first[ext]!r}); webdataset refuses such a sample: give each member "
                             "of a sample its own extension")
        first[ext] = name
        record[ext] = data
    return record


class _StrictTarInfo(tarfile.TarInfo):
    """A member header reader that reports a missing, cut or invalid header as damage.

    tarfile ends the archive silently at such a header (past the first member), so a shard cut
    exactly at a member boundary would read as a shorter, valid one. Only an all-zero block, the
    end-of-archive marker, ends the archive here.
    """

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:
            raise
        except tarfile.EmptyHeaderError as e:
            raise tarfile.ReadError(f"the tar ends at byte {tar.offset} without its "
                                    "end-of-archive marker") from e
        except tarfile.TruncatedHeaderError as e:
            raise tarfile.ReadError(f"the tar ends inside the member header at byte {tar.offset}") from e
        except tarfile.HeaderError as e:
            raise tarfile.ReadError(f"invalid member header at byte {tar.offset} ({e})") from e


def iter_samples(fileobj: IO[bytes], bare: bool = True) -> Iterator[Sample]:
    """Samples of a tar stream (plain or gzip), in tar order.

    Non-file members and files whose name starts with `__` or `.` are left out; so are files
    without an extension when `bare` is False (as webdataset's reader leaves them out: they do
    not split a sample then). A damaged shard raises tarfile.TarError (or the error of the gzip
    stream); an I/O error of `fileobj` propagates as it is.
    """
    with tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_StrictTarInfo) as tar:
        key: str | None = None
        files: list[tuple[str, bytes]] = []
        for info in tar:
            if not info.isfile() or info.name.rpartition("/")[2].startswith(("__", ".")):
                continue
            k, ext = split_member(info.name)
            if not ext and not bare:
                continue
            if key is not None and k != key:
                yield Sample(key, tuple(files))
                files = []
            key = k
            data = tar.extractfile(info)
            files.append((info.name, data.read() if data is not None else b""))
        if key is not None:
            yield Sample(key, tuple(files))


def decode_tokens(data: bytes, ext: str, field: str | None) -> np.ndarray:
    """Token ids from an .npy (no pickle), .safetensors (one tensor) or JSON list member.

    Raises ValueError saying what is wrong with the member.
    """
    base = ext[:-3] if ext.endswith(".gz") else ext
    if base.endswith("npy"):
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as e:  # the bytes are in memory: any error (numpy raises many) is the member's
            raise ValueError(f"not a readable .npy array ({type(e).__name__}: {e})") from None
    elif base.endswith("safetensors"):
        array = _safetensors_array(data, field)
    elif base.endswith("json"):
        array = _json_array(data, field)
    else:
        raise ValueError(f"extension {ext!r} does not hold token ids (use one of "
                         f"{', '.join(TOKEN_EXTENSIONS)})")
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"holds a {array.dtype} array of shape {array.shape}, not a 1-D array of "
                         "integer token ids")
    return array


def _safetensors_array(data: bytes, field: str | None) -> np.ndarray:
    """The one tensor of a safetensors member, or the one named `field`."""
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # the bytes are in memory: any error (SafetensorError...) is the member's
        raise ValueError(f"not a readable safetensors file ({type(e).__name__}: {e})") from None
    if field is None and len(tensors) != 1:
        raise ValueError(f"holds tensors {sorted(tensors)}; name one, e.g. "
                         f"text_key='safetensors:{sorted(tensors)[0]}'")
    if field is not None and field not in tensors:
        raise ValueError(f"holds no tensor {field!r} (it has {sorted(tensors)})")
    return tensors[field] if field else next(iter(tensors.values()))


def _json_array(data: bytes, field: str | None) -> np.ndarray:
    """A JSON list of integer ids (or the list in field `field` of a JSON object)."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise ValueError(f"malformed JSON ({type(e).__name__}: {e})") from None
    if field is not None:
        obj = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(obj, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                            for x in obj):
        raise ValueError("is not a JSON list of integer token ids")
    try:
        return np.asarray(obj, dtype=np.int64) if obj else np.zeros(0, dtype=np.int64)
    except OverflowError:
        raise ValueError("holds a token id beyond 64 bits") from None
