"""Cache files: block files, offset sidecars, and the v1 manifest (see docs/format.md).

Format v2 keeps these files and replaces v1's one manifest, rewritten at every commit, by a
header plus an append-only commit log and block index (see `ledger`).

Everything on disk is safetensors or JSON: opening a cache never unpickles anything. Files are
written through a Storage (see storage.py), so a reader never sees a partial file.

Reading is defensive, because a cache may be damaged or hostile: every file is opened through
:class:`CacheDir` (regular files inside the cache directory only, sizes checked before reading),
and :func:`read_manifest` validates every manifest field a reader uses, so a bad cache gives a
:class:`CacheFormatError` naming the file, never a hang, a huge allocation or an internal error.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import reprlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import CacheFormatError
from .storage import BLOCK_DIR, MANIFEST as MANIFEST_NAME
from .storage import TMP_MARK, LocalStorage, RemoteStorage, Storage, open_regular, read_regular

FORMAT_NAME = "torchcache"
FORMAT_VERSION = 2  # the layout new builds write (v2: see ledger.py); v1 caches stay readable
READABLE_VERSIONS = (1, 2, 3)  # v3: v2 plus a documents sidecar per block (documents.py)
BLOCK_FILE_VERSION = "1"  # block, offsets and keys files are the same in v1 and v2
TOKENIZER_NAME = "tokenizer.json"
#: every name a cache's tokenizer may be stored under (tiktoken's ranks and settings, a
#: SentencePiece model: format.tiktoken_backend, format.sentencepiece_backend)
TOKENIZER_NAMES = (TOKENIZER_NAME, "tokenizer.tiktoken", "tokenizer.tiktoken.json", "tokenizer.model")
# written whole at a cache's top
TOP_FILES = re.compile(r"(manifest|tokenizer|head)\.json|tokenizer\.(tiktoken|tiktoken\.json|model)")
BLOCK_FILES = re.compile(r"\d{6}-\d{6}(\.offsets\.safetensors|\.docs\.safetensors"
                         r"|\.arrays\.safetensors|\.keys\.json|\.safetensors)")

# safetensors dtype names of the arrays a cache holds: tokens (U16, U32), offsets (I64)
DTYPES = {"U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"),
          "I32": np.dtype("<i4"), "U8": np.dtype("u1")}  # (the last two: v3 documents sidecars)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
TOKEN_DTYPES = ("U16", "U32")
MAX_HEADER_BYTES = 1 << 20  # a larger safetensors header is refused as corrupted

# Size caps, checked before anything is read, so a corrupted file cannot make a reader allocate
# gigabytes. A v1 manifest takes about 450 bytes per block (128 MiB: ~300k blocks);
# TORCHCACHE_MAX_MANIFEST_BYTES raises the cap for a larger, genuine one.
MAX_MANIFEST_BYTES = 128 << 20
MAX_KEYS_BYTES = 128 << 20
MAX_TOKENIZER_BYTES = 128 << 20
MAX_BLOCK_DOCUMENTS = (1 << 27) - 1  # offsets sidecar of at most 1 GiB
MAX_BLOCK_TOKENS = 1 << 40
MAX_BLOCK_INDEX = 10 ** 9
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def is_fingerprint(value: str) -> bool:
    """32 lowercase hex digits (safe as a directory name)."""
    return bool(_FINGERPRINT.fullmatch(value))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return DTYPES["U16"] if vocab_size <= 1 << 16 else DTYPES["U32"]


def dtype_name(dtype: np.dtype) -> str:
    return _DTYPE_NAMES[np.dtype(dtype).newbyteorder("<")]


def block_name(input_index: int, block_index: int) -> str:
    """Relative path of a block file; its name is fixed by (input, block) so rebuilds are identical."""
    return f"{BLOCK_DIR}/{input_index:06d}-{block_index:06d}.safetensors"


def offsets_name(block_path: str) -> str:
    return block_path[: -len(".safetensors")] + ".offsets.safetensors"


def keys_name(block_path: str) -> str:
    return block_path[: -len(".safetensors")] + ".keys.json"


def docs_name(block_path: str) -> str:
    """A v3 block's documents sidecar (see documents.py)."""
    return block_path[: -len(".safetensors")] + ".docs.safetensors"


class StreamCursor:
    """Where the committed stream stands, advanced as blocks finish: the one implementation of
    the stream order, for the builder (blocks join as they finish) and for readers and checks
    (:func:`stream_order`, all at once).

    Round robin over the inputs, block by block: input 0 block 0, input 1 block 0, ..., input 0
    block 1, ... An input that is done and has no more blocks drops out of the rotation; the
    stream stops (incomplete) at the first input that is not done and has no next block yet.
    A pure function of the inputs' finished-block counts and done flags, so the builder and the
    reader agree on it. Each `advance` costs O(blocks that join + inputs that drop out).
    """

    def __init__(self, n_inputs: int):
        self.active: list[int] = list(range(n_inputs))
        self.next_active: list[int] = []
        self.pos = self.round = 0
        self.complete = False

    def advance(self, count: Callable[[int], int], done: Callable[[int], bool]) -> list[tuple[int, int]]:
        """The (input, block) pairs that join the stream now, given each input's finished-block
        `count` and whether it is `done`."""
        joined: list[tuple[int, int]] = []
        while self.active:
            while self.pos < len(self.active):
                i = self.active[self.pos]
                if self.round < count(i):
                    joined.append((i, self.round))
                    self.next_active.append(i)
                elif not done(i):
                    return joined  # the stream waits for input i's next block
                self.pos += 1
            self.active, self.next_active = self.next_active, []
            self.pos, self.round = 0, self.round + 1
        self.complete = True
        return joined


def stream_order(blocks_per_input: Sequence[int], done: Sequence[bool]) -> tuple[list[tuple[int, int]], bool]:
    """The committed stream as (input, block) pairs, and whether it is the whole (final) stream
    (see :class:`StreamCursor`); O(total blocks + inputs).

    >>> stream_order([2, 1], [True, False])   # input 1 may still make a block 1
    ([(0, 0), (1, 0), (0, 1)], False)
    >>> stream_order([2, 1], [True, True])
    ([(0, 0), (1, 0), (0, 1)], True)
    """
    cursor = StreamCursor(len(blocks_per_input))
    order = cursor.advance(blocks_per_input.__getitem__, done.__getitem__)
    return order, cursor.complete


def safetensors_bytes(name: str, array: np.ndarray, metadata: dict[str, str]) -> tuple[bytes, int]:
    """Header bytes of a one-tensor safetensors file, and the offset where its data starts."""
    return tensors_header({name: array}, metadata)


def tensors_header(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[bytes, int]:
    """Header bytes of a safetensors file of 1-D `tensors`, stored in name order, and the offset
    where their data starts. The same tensors always give the same bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    end = 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": dtype_name(array.dtype), "shape": [int(array.shape[0])],
                        "data_offsets": [end, end + int(array.nbytes)]}
        end += int(array.nbytes)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, 8 + len(raw)


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    checksum: str


def write_tensor_file(storage: "Storage", rel_path: str, name: str, array: np.ndarray,
                      metadata: dict[str, str]) -> WrittenFile:
    """Write a one-tensor safetensors file so that it appears whole or not at all."""
    return write_tensors_file(storage, rel_path, {name: array}, metadata)


def write_tensors_file(storage: "Storage", rel_path: str, tensors: dict[str, np.ndarray],
                       metadata: dict[str, str]) -> WrittenFile:
    """Write a safetensors file of 1-D `tensors` so that it appears whole or not at all."""
    head, _ = tensors_header(tensors, metadata)
    parts: list[Any] = [head]
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        parts.append(memoryview(array.astype(array.dtype.newbyteorder("<"), copy=False)).cast("B"))
    size, checksum = storage.write(rel_path, parts)
    return WrittenFile(rel_path, size, checksum)


def write_keys_file(storage: "Storage", rel_path: str, keys: list[str | None]) -> WrittenFile:
    """Write a block's document keys (a JSON list of strings), like a tensor file."""
    data = json.dumps(keys, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    size, checksum = storage.write(rel_path, [data])
    return WrittenFile(rel_path, size, checksum)


# ---------------------------------------------------------------- reading files safely

@dataclass(frozen=True)
class TensorHeader:
    dtype: np.dtype
    length: int
    data_start: int


def read_into(fd: int, dest: memoryview, offset: int, path: str,
              fix: str = "run `torchcache verify`", what: str = "file") -> None:
    """Fill `dest` with the bytes of open file `fd` from `offset`: the one exact read of the
    package. Errors name `path`; a file that ends too soon is a CacheFormatError ("unexpected end
    of `what`") ending with `fix`, what the user should do."""
    got = 0
    while got < len(dest):
        try:
            n = os.preadv(fd, [dest[got:] if got else dest], offset + got)
        except OSError as e:
            raise OSError(e.errno, f"{path}: {e.strerror}") from e
        if n == 0:
            raise CacheFormatError(f"{path}: unexpected end of {what} (truncated?); {fix}")
        got += n


def read_exact(fd: int, offset: int, size: int, path: str) -> bytearray:
    """Exactly `size` bytes at `offset` (the caller has checked `size` against the file size)."""
    data = bytearray(size)
    read_into(fd, memoryview(data), offset, path)
    return data


def read_tensor_header(fd: int, path: str, name: str, file_size: int) -> TensorHeader:
    """Parse and check the header of a one-tensor safetensors file; errors name the file.

    Reads at most 1 MiB, and checks that the header, the tensor's length and the file size agree
    before any tensor data is read.
    """
    return read_tensors_header(fd, path, (name,), (), file_size)[name]


def read_tensors_header(fd: int, path: str, required: Sequence[str], optional: Sequence[str],
                        file_size: int) -> dict[str, TensorHeader]:
    """The checked headers of a safetensors file of 1-D tensors: every `required` name, any of
    the `optional` ones and nothing else, stored back to back in name order, exactly filling the
    file. Errors name the file."""
    prefix = read_exact(fd, 0, 8, path) if file_size >= 8 else b""
    if len(prefix) < 8:
        raise CacheFormatError(f"{path}: truncated safetensors file (no header); run `torchcache verify`")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
        raise CacheFormatError(f"{path}: corrupted safetensors header length {header_len}; "
                               "run `torchcache verify`")
    try:
        header = json.loads(read_exact(fd, 8, header_len, path))
    except (ValueError, RecursionError) as e:
        raise CacheFormatError(f"{path}: corrupted safetensors header ({e}); "
                               "run `torchcache verify`") from None
    entries = _tensor_entries(header, required, optional, path)
    end = max((start + length * dtype.itemsize for dtype, length, start in entries.values()), default=0)
    expected = 8 + header_len + end
    if file_size != expected:
        raise CacheFormatError(
            f"{path}: file is {file_size} bytes, its header says {expected}: the file is "
            "truncated or corrupted; rebuild it (delete the cache and build again)")
    return {name: TensorHeader(dtype, length, 8 + header_len + start)
            for name, (dtype, length, start) in entries.items()}


def _tensor_entries(header: Any, required: Sequence[str], optional: Sequence[str],
                    path: str) -> dict[str, tuple[np.dtype, int, int]]:
    """(dtype, length, data start) of each tensor of a safetensors header (whose metadata must
    be a map of strings, as safetensors requires), checked to lie back to back in name order."""
    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: corrupted safetensors header ({what}); run `torchcache verify`")

    if not isinstance(header, dict):
        raise bad("not a map")
    for name in required:
        if not isinstance(header.get(name), dict):
            raise bad(f"no tensor {name!r}")
    extra = set(header) - set(required) - set(optional) - {"__metadata__"}
    if extra:
        raise bad(f"unexpected entries {_short.repr(sorted(extra))}")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("metadata is not a map of strings")
    entries, end = {}, 0
    for name in sorted(set(header) - {"__metadata__"}):
        entry = header[name]
        if not isinstance(entry, dict):
            raise bad(f"entry {name!r} is not a map")
        dtype_field, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype_field, str) or dtype_field not in DTYPES:
            raise bad(f"dtype {_short.repr(dtype_field)}")
        if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
            raise bad(f"shape {_short.repr(shape)} is not one length")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)):
            raise bad(f"data_offsets {_short.repr(offsets)}")
        dtype, length = DTYPES[dtype_field], shape[0]
        if offsets != [end, end + length * dtype.itemsize]:
            raise bad("tensor offsets disagree with its shape")
        entries[name] = (dtype, length, end)
        end = offsets[1]
    return entries


def read_tensor_data(fd: int, path: str, header: TensorHeader) -> np.ndarray:
    """The tensor of a checked header (its size already matches the file's)."""
    data = read_exact(fd, header.data_start, header.length * header.dtype.itemsize, path)
    array = np.frombuffer(data, dtype=header.dtype)
    array.flags.writeable = False  # as a cache's arrays are: shared, never changed in place
    return array


def read_tensor_file(path: str, name: str, max_length: int = MAX_BLOCK_DOCUMENTS + 1) -> np.ndarray:
    """Read a whole (small) one-tensor safetensors file, e.g. an offsets sidecar."""
    fd = open_regular(path)
    try:
        header = read_tensor_header(fd, path, name, os.fstat(fd).st_size)
        if header.length > max_length:
            raise CacheFormatError(f"{path}: holds {header.length:,} values, more than the "
                                   f"{max_length:,} expected; the file is corrupted")
        return read_tensor_data(fd, path, header)
    finally:
        os.close(fd)


def fd_checksum(fd: int, chunk: int = 1 << 22) -> str:
    """sha256 of a whole open regular file (read with pread: its position is left alone)."""
    digest, offset = hashlib.sha256(), 0
    while data := os.pread(fd, chunk, offset):
        digest.update(data)
        offset += len(data)
    return "sha256:" + digest.hexdigest()


def file_checksum(path: str, chunk: int = 1 << 22) -> str:
    """sha256 of a regular file (a FIFO or device is refused: it could block or never end)."""
    fd = open_regular(path)
    try:
        return fd_checksum(fd, chunk)
    finally:
        os.close(fd)


def safe_join(root: str, rel_path: str) -> str:
    """Join a manifest path to the cache root, refusing anything that escapes it (lexically)."""
    if (not isinstance(rel_path, str) or not rel_path or rel_path.startswith(("/", "\\"))
            or "\\" in rel_path or ":" in rel_path or any(ord(c) < 32 for c in rel_path)):
        raise CacheFormatError(f"manifest names an unsafe path {_short.repr(rel_path)}; refusing to open it")
    norm = posixpath.normpath(rel_path)
    if norm.startswith("..") or norm == ".":
        raise CacheFormatError(f"manifest path {rel_path!r} leaves the cache directory; refusing it")
    return os.path.join(root, *norm.split("/"))


class CacheDir:
    """A local cache directory; the one way a reader opens the files in it.

    A file is opened only if its real path (symlinks resolved) lies inside the real cache
    directory and it is a regular file; whole-file reads are capped before reading. Symlinks that
    stay inside the cache are fine.
    """

    def __init__(self, root: str):
        self.root = root
        self.real = os.path.realpath(root)

    def path(self, rel: str) -> str:
        """The path of a cache file, refused if it (or a directory above it) leads outside."""
        path = safe_join(self.root, rel)
        real = os.path.realpath(path)
        if real != self.real and not real.startswith(self.real.rstrip(os.sep) + os.sep):
            raise CacheFormatError(f"{path}: leads outside the cache directory (to {real}); refusing "
                                   "to follow it. Copy the file into the cache instead of linking it")
        return path

    def open(self, rel: str) -> tuple[str, int]:
        """(path, read-only descriptor) of a regular file inside the cache."""
        path = self.path(rel)
        return path, open_regular(path)

    def read(self, rel: str, limit: int) -> bytes:
        """The whole of a regular file inside the cache, refused if larger than `limit` bytes."""
        return read_regular(self.path(rel), limit)


# ---------------------------------------------------------------- leftovers of killed writers

def remove_dead_temp_files(storage: "Storage", folder: str, own: "re.Pattern[str]") -> list[str]:
    """Delete the temporary files in `folder` that a killed writer left: `NAME.tmp-PID`, as
    LocalStorage.write names them, where `own` matches NAME and process PID no longer exists.

    The one way builds, `pack`, `upgrade` and `repair` clean up after a crash. A live process's
    file is kept (it may be renaming it right now), and so is any name the writers never use.
    Object stores are written in one put, so they hold no temporary files. Returns the deleted
    paths, relative to the storage root.
    """
    if not isinstance(storage, LocalStorage):
        return []
    deleted = []
    for name in storage.listdir(folder):
        final, mark, pid = name.rpartition(TMP_MARK)
        if mark and pid.isdigit() and own.fullmatch(final) and not _process_exists(int(pid)):
            rel = f"{folder}/{name}" if folder else name
            storage.delete(rel)
            deleted.append(rel)
    return deleted


def _process_exists(pid: int) -> bool:
    """Whether process `pid` runs on this machine (signal 0 checks without signalling). A
    zombie, a dead process nobody has reaped yet (an orphan in a container whose init does not
    reap), runs no more."""
    if not 0 < pid < 2 ** 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:  # no /proc (macOS), or it has just exited
        return True
    return state not in ([b"Z"], [b"X"])


# ---------------------------------------------------------------- the manifest

def manifest_limit() -> int:
    """The manifest size cap (TORCHCACHE_MAX_MANIFEST_BYTES, else MAX_MANIFEST_BYTES)."""
    value = os.environ.get("TORCHCACHE_MAX_MANIFEST_BYTES", "")
    return int(value) if value.isdigit() else MAX_MANIFEST_BYTES


def load_manifest(storage: "Storage") -> tuple[dict[str, Any], int, str]:
    """A cache's manifest.json decoded, its format version, and its path (for messages).

    Only the version is checked here: `ledger.read_manifest` validates the rest, per version.
    """
    path = f"{storage.url}/{MANIFEST_NAME}"
    try:
        data = _manifest_bytes(storage)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no manifest; {storage.url!r} is not a torchcache cache (or its build has not "
            "committed anything yet)") from None
    manifest = decode_json(data, path, "manifest")
    return manifest, manifest_version(manifest, path), path


def _manifest_bytes(storage: "Storage") -> bytes:
    return read_capped_file(storage, MANIFEST_NAME, manifest_limit())


def decode_json(data: bytes, path: str, what: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CacheFormatError(f"{path}: {what} is not valid JSON ({e}); restore it or rebuild "
                               "the cache") from None


def read_capped_file(storage: "Storage", rel: str, limit: int) -> bytes:
    """A whole cache file, refused if larger than `limit` bytes: the one capped whole-file read.
    A local file must be a regular file inside the cache directory; a remote one is fetched with
    one ranged request, which cannot return more than `limit` + 1 bytes."""
    if isinstance(storage, LocalStorage):
        return CacheDir(storage.root).read(rel, limit)
    if not isinstance(storage, RemoteStorage):
        return storage.read(rel)
    data = storage.read_range(rel, 0, limit + 1)
    if len(data) > limit:
        raise CacheFormatError(f"{storage.url}/{rel}: more than the {limit:,} bytes allowed for this "
                               "file; it is corrupted or not part of a torchcache cache")
    return data


class _Fields:
    """Checks of the fields of one manifest, each error naming the manifest and the field."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, what: str) -> CacheFormatError:
        return CacheFormatError(f"{self.path}: {where} {what}; the manifest is corrupted (restore "
                                "it or rebuild the cache)")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            raise self.fail(where, f"lacks {key!r}")
        return obj[key]

    def dict(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be an object, not {_short.repr(value)}")
        return value

    def list(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list, not {_short.repr(value)}")
        return value

    def int(self, value: Any, where: str, low: int, high: int) -> int:
        if type(value) is not int or not low <= value <= high:  # bool is not an int here
            raise self.fail(where, f"must be an integer in [{low}, {high}], not {_short.repr(value)}")
        return value

    def optional_int(self, value: Any, where: str, low: int, high: int) -> int | None:
        return None if value is None else self.int(value, where, low, high)

    def str(self, value: Any, where: str, pattern: "re.Pattern | None" = None) -> str:
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            raise self.fail(where, f"must be a {'well-formed ' if pattern else ''}string, not "
                                   f"{_short.repr(value)}")
        return value

    def bool(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"must be true or false, not {_short.repr(value)}")
        return value

    def equal(self, value: Any, expected: Any, where: str) -> None:
        if value != expected:
            raise self.fail(where, f"is {_short.repr(value)}, expected {_short.repr(expected)}")


def manifest_version(manifest: Any, path: str) -> int:
    """The format version of a decoded manifest; CacheFormatError if this version cannot read it."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{path}: not a torchcache manifest")
    version = manifest.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise CacheFormatError(
            f"{path}: format version {_short.repr(version)}; this torchcache reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Upgrade torchcache or rebuild the cache")
    return version


def check_header(manifest: Any, path: str) -> dict[str, Any]:
    """Validate a v2 manifest (the header: spec and fingerprint); return its spec."""
    f = _Fields(path)
    for key in ("spec", "fingerprint"):
        f.get(manifest, key, "manifest")
    spec = _check_identity(f, manifest)
    return spec


def _check_identity(f: "_Fields", manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's spec and fingerprint, checked (and its version against the spec: only v3
    has documents); return the spec."""
    spec = _check_spec(f, manifest["spec"])
    documents = spec.get("documents") is not None
    if documents != (manifest.get("version") == 3):
        raise f.fail("version", f"is {manifest.get('version')}, but the spec "
                                f"{'has' if documents else 'has no'} documents (v3 caches only have them)")
    f.str(manifest["fingerprint"], "fingerprint", _FINGERPRINT)
    if manifest["fingerprint"] != spec_fingerprint(spec):
        raise f.fail("fingerprint", "does not match the spec (the spec or the fingerprint was edited)")
    return spec


def check_block_entry(entry: Any, where: str, n_inputs: int, path: str) -> None:
    """Validate one block entry (a v1 manifest's, or a v2 commit log's)."""
    _check_block_entry(_Fields(path), entry, where, n_inputs)


def check_input_progress(progress: Any, where: str, path: str) -> None:
    """Validate one input's progress (records, skipped counts, blocks, digest)."""
    f = _Fields(path)
    progress = f.dict(progress, where)
    f.int(f.get(progress, "records", where), f"{where}.records", 0, 1 << 62)
    f.int(f.get(progress, "blocks", where), f"{where}.blocks", 0, MAX_BLOCK_INDEX)
    for reason, count in f.dict(f.get(progress, "skipped", where), f"{where}.skipped").items():
        f.int(count, f"{where}.skipped[{reason!r}]", 0, 1 << 62)
    if progress.get("digest") is not None:
        f.str(progress["digest"], f"{where}.digest", re.compile(r"[0-9a-f]{64}"))


def check_manifest(manifest: Any, path: str) -> None:
    """Validate every field of a v1 manifest a reader uses; CacheFormatError naming the file and
    field."""
    version = manifest_version(manifest, path)
    if version != 1:
        raise CacheFormatError(f"{path}: a format v{version} manifest, not v1 (read it with ledger)")
    f = _Fields(path)
    for key in ("spec", "blocks", "inputs", "complete", "fingerprint"):
        f.get(manifest, key, "manifest")
    spec = _check_identity(f, manifest)
    f.bool(manifest["complete"], "complete")
    _check_progress(f, manifest["inputs"], len(spec["inputs"]))
    skipped = f.dict(manifest.get("skipped", {}), "skipped")
    for reason, count in skipped.items():
        f.int(count, f"skipped[{reason!r}]", 0, 1 << 62)
    blocks = f.list(manifest["blocks"], "blocks")
    pending = f.list(manifest.get("pending", []), "pending")
    for name, entries in (("blocks", blocks), ("pending", pending)):
        for k, entry in enumerate(entries):
            _check_block_entry(f, entry, f"{name}[{k}]", len(spec["inputs"]))
    for total in ("num_tokens", "num_documents"):
        if total in manifest:  # the stream's totals, when recorded, must add up
            f.equal(f.int(manifest[total], total, 0, 1 << 62), sum(e[total] for e in blocks), total)


def _check_spec(f: _Fields, spec: Any) -> dict[str, Any]:
    spec = f.dict(spec, "spec")
    tokenizer = f.get(spec, "tokenizer", "spec")
    if tokenizer is not None:
        f.str(f.get(f.dict(tokenizer, "spec.tokenizer"), "fingerprint", "spec.tokenizer"),
              "spec.tokenizer.fingerprint")
    vocab_size = f.optional_int(f.get(spec, "vocab_size", "spec"), "spec.vocab_size", 1, 1 << 32)
    dtype = f.get(spec, "dtype", "spec")
    if dtype not in TOKEN_DTYPES:
        raise f.fail("spec.dtype", f"must be one of {TOKEN_DTYPES}, not {_short.repr(dtype)}")
    expected = "U32" if vocab_size is None else dtype_name(token_dtype(vocab_size))
    f.equal(dtype, expected, f"spec.dtype (for vocab_size {vocab_size})")
    top = (vocab_size or (1 << (8 * DTYPES[dtype].itemsize))) - 1
    for key in ("bos_id", "eos_id"):
        f.optional_int(f.get(spec, key, "spec"), f"spec.{key}", 0, top)
    for k, item in enumerate(f.list(f.get(spec, "inputs", "spec"), "spec.inputs")):
        f.str(f.get(f.dict(item, f"spec.inputs[{k}]"), "path", f"spec.inputs[{k}]"),
              f"spec.inputs[{k}].path")
    if "block_array_bytes" in spec:  # builds with arrays (how their blocks were cut)
        f.int(spec["block_array_bytes"], "spec.block_array_bytes", 1, 1 << 62)
    if spec.get("documents") is not None:
        _check_documents_spec(f, spec["documents"])
    return spec


def _check_documents_spec(f: _Fields, documents: Any) -> None:
    """A v3 spec's `documents`: how records became documents, and what each keeps."""
    documents = f.dict(documents, "spec.documents")
    get = lambda key: f.get(documents, key, "spec.documents")  # noqa: E731
    f.str(get("input_format"), "spec.documents.input_format")
    f.bool(get("loss_mask"), "spec.documents.loss_mask")
    for key in ("chat_template", "train_on"):
        if get(key) is not None:
            f.str(get(key), f"spec.documents.{key}")
    for k, name in enumerate(f.list(get("keep_fields"), "spec.documents.keep_fields")):
        f.str(name, f"spec.documents.keep_fields[{k}]")
    if "arrays" in documents:  # name -> {"dtype": str | None, "shape": [int | None, ...] | None}
        for name, declared in f.dict(documents["arrays"], "spec.documents.arrays").items():
            where = f"spec.documents.arrays.{name}"
            declared = f.dict(declared, where)
            if declared.get("dtype") is not None:
                f.str(declared["dtype"], f"{where}.dtype")
            if declared.get("shape") is not None:
                for k, dim in enumerate(f.list(declared["shape"], f"{where}.shape")):
                    if dim is not None:
                        f.int(dim, f"{where}.shape[{k}]", 0, 1 << 62)
            if "per_token" in declared:  # one row per token: a shape [None, sizes...]
                f.bool(declared["per_token"], f"{where}.per_token")
                shape = declared.get("shape")
                if not isinstance(shape, list) or not shape or shape[0] is not None \
                        or any(d is None for d in shape[1:]):
                    raise f.fail(f"{where}.shape", "of a per-token field must be [null, sizes...]")


def _check_progress(f: _Fields, inputs: Any, n_inputs: int) -> None:
    inputs = f.list(inputs, "inputs")
    f.equal(len(inputs), n_inputs, "inputs (its length, one per spec input)")
    for k, item in enumerate(inputs):
        where = f"inputs[{k}]"
        item = f.dict(item, where)
        f.bool(f.get(item, "done", where), f"{where}.done")
        f.int(f.get(item, "blocks", where), f"{where}.blocks", 0, MAX_BLOCK_INDEX)


def _check_block_entry(f: _Fields, entry: Any, where: str, n_inputs: int) -> None:
    entry = f.dict(entry, where)
    get = lambda key: f.get(entry, key, where)  # noqa: E731
    if not n_inputs:
        raise f.fail(where, "is a block, but the spec has no inputs")
    source = f.int(get("input"), f"{where}.input", 0, n_inputs - 1)
    index = f.int(get("index"), f"{where}.index", 0, MAX_BLOCK_INDEX - 1)
    name = block_name(source, index)
    path = f.str(get("path"), f"{where}.path")
    f.equal(path, name, f"{where}.path (the name follows from input and index)")
    f.equal(f.str(get("offsets"), f"{where}.offsets"), offsets_name(name), f"{where}.offsets")
    f.str(get("checksum"), f"{where}.checksum", _CHECKSUM)
    f.str(get("offsets_checksum"), f"{where}.offsets_checksum", _CHECKSUM)
    if "keys" in entry or "keys_checksum" in entry:
        f.equal(f.str(get("keys"), f"{where}.keys"), keys_name(name), f"{where}.keys")
        f.str(get("keys_checksum"), f"{where}.keys_checksum", _CHECKSUM)
    if "docs" in entry or "docs_checksum" in entry:
        f.equal(f.str(get("docs"), f"{where}.docs"), docs_name(name), f"{where}.docs")
        f.str(get("docs_checksum"), f"{where}.docs_checksum", _CHECKSUM)
    f.int(get("size"), f"{where}.size", 8, 1 << 62)
    tokens = f.int(get("num_tokens"), f"{where}.num_tokens", 0, MAX_BLOCK_TOKENS)
    documents = f.int(get("num_documents"), f"{where}.num_documents", 0, MAX_BLOCK_DOCUMENTS)
    if documents == 0 and tokens:
        raise f.fail(where, f"has {tokens} tokens in 0 documents")


def stream_order_problem(manifest: dict[str, Any]) -> str | None:
    """Why the blocks of a (validated) manifest are not in stream order, or None if they are.

    `blocks` must be exactly :func:`stream_order` of the inputs' progress, `pending` the rest of
    their finished blocks (each once), and `complete` must say whether the stream is whole.
    """
    counts = [p["blocks"] for p in manifest["inputs"]]
    done = [p["done"] for p in manifest["inputs"]]
    blocks, pending = manifest["blocks"], manifest.get("pending", [])
    if sum(counts) != len(blocks) + len(pending):
        return (f"the inputs' progress counts {sum(counts)} finished blocks, but blocks and pending "
                f"list {len(blocks) + len(pending)}")
    expected, complete = stream_order(counts, done)
    for k, (entry, (i, j)) in enumerate(zip(blocks, expected)):
        if (entry["input"], entry["index"]) != (i, j):
            return (f"blocks[{k}] is input {entry['input']} block {entry['index']}, but the stream order "
                    f"(round robin over the inputs) puts input {i} block {j} there")
    if len(blocks) != len(expected):
        k = min(len(blocks), len(expected))
        what = "more" if len(blocks) > len(expected) else "fewer"
        return (f"blocks lists {len(blocks)} entries, {what} than the stream order allows "
                f"({len(expected)}); the first out of place is blocks[{k}]")
    rest = sorted((e["input"], e["index"]) for e in pending)
    if rest != sorted(set(_all_blocks(counts)) - set(expected)):
        return "pending does not list exactly the finished blocks not yet in the stream"
    if manifest["complete"] != complete:
        return f"complete is {manifest['complete']}, but the inputs' progress says {complete}"
    return None


def _all_blocks(counts: Sequence[int]) -> list[tuple[int, int]]:
    return [(i, j) for i, n in enumerate(counts) for j in range(n)]


def spec_fingerprint(spec: dict[str, Any]) -> str:
    """Identity of a cache: the final cache is a pure function of its spec."""
    # version 1 for ever: a cache's identity does not change when its layout is upgraded to v2
    canon = json.dumps({"format": FORMAT_NAME, "version": 1, "spec": spec},
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]
