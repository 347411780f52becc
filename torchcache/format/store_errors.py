"""A remote store's refusal (missing or refused credentials, a missing bucket, an unreachable
endpoint) told in one line: the URL, what was refused, and what to do.

The command line prints :func:`store_message` instead of a traceback. The error is recognised
from its chain of causes: the store's error code (S3's, as botocore reports it), botocore's own
exception classes, or fsspec's PermissionError / FileNotFoundError; a missing bucket is
confirmed by asking the store (see `storage.missing_bucket`). Remedies name the command line's
`--storage-option KEY=VALUE`.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

import fsspec

from .storage import BUCKET_SCHEMES, missing_bucket

__all__ = ["ENDPOINT_EXAMPLE", "store_message"]

ENDPOINT_EXAMPLE = '{"endpoint_url": "http://127.0.0.1:9000"}'
# Error codes of object stores (S3's, as botocore reports them) that mean the credentials
# were missing, wrong, expired or not allowed; and the one that means the bucket is missing.
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "InvalidSecurity",
                     "AuthorizationHeaderMalformed", "401", "403", "Forbidden", "Unauthorized"}
_NO_BUCKET_CODES = {"NoSuchBucket"}


def store_message(error: BaseException, remote_urls: Callable[[], list[str]],
                  storage_options: dict[str, Any] | None, output: str | None,
                  describe: Callable[[BaseException], str]) -> str | None:
    """A remote store's refusal as one line: the URL, what was refused and what to do; None
    when the error is not such a refusal.

    `remote_urls` gives the remote URLs the command names (asked only for a refusal), `output`
    the one it writes (None: it writes none), and `describe` a cause as one line.

    >>> urls = lambda: ["s3://bucket/cache"]
    >>> print(store_message(PermissionError("Access Denied"), urls, None, None, str))
    s3://bucket/cache: the store refused the credentials (Access Denied); pass them with --storage-option ...
    >>> print(store_message(ValueError("seq_len must be >= 1"), urls, None, None, str))
    None
    """
    refusal = _store_refusal(error)
    urls = [] if refusal is None else remote_urls()
    if not urls:
        return None
    kind, cause = refusal
    if kind in ("bucket", "not found"):
        missing = _missing_bucket(urls, storage_options)
        if missing is None:
            return None  # the bucket is there: the error's own message says what is missing
        url, bucket = missing
        return _no_bucket_message(url, bucket, writing=url == output)
    url = _named_url(error, urls)
    detail = describe(cause)
    if kind == "unreachable":
        endpoint = _endpoint_option(url)
        return (f"{url}: cannot reach the store ({detail}); check the network and the endpoint"
                + (f" ({endpoint})" if endpoint else ""))
    what = ("no credentials for the store" if kind == "no credentials"
            else "the store refused the credentials")
    return f"{url}: {what} ({detail}); {_credentials_remedy(url)}"


def _credentials_remedy(url: str) -> str:
    scheme = url.partition("://")[0]
    if scheme in ("s3", "s3a"):
        return ("pass them with --storage-option key=ACCESS_KEY --storage-option secret=SECRET_KEY, "
                "or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if scheme in ("gs", "gcs"):
        return ("pass them with --storage-option token=KEY_FILE.json, or set "
                "GOOGLE_APPLICATION_CREDENTIALS")
    if scheme in ("az", "abfs", "abfss"):
        return ("pass them with --storage-option account_name=NAME --storage-option account_key=KEY, "
                "or set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY")
    return "pass them with --storage-option KEY=VALUE (the options of the store's fsspec filesystem)"


def _endpoint_option(url: str) -> str:
    """How the endpoint of the URL's store is given, where it has one to give."""
    if url.partition("://")[0] in ("s3", "s3a"):
        return f"--storage-option client_kwargs='{ENDPOINT_EXAMPLE}'"
    return ""


def _causes(error: BaseException) -> list[BaseException]:
    """The error and the chain of errors that caused it (explicit or implicit), in order."""
    chain: list[BaseException] = []
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _error_code(error: BaseException) -> str | None:
    """The store's error code of a botocore ClientError (or of anything carrying its response)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        return str(response["Error"].get("Code"))
    return None


def _botocore_errors() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """botocore's (no-credentials, connection, all) exception classes; empty where no store
    client loaded botocore (then none of its errors can have been raised)."""
    boto = sys.modules.get("botocore.exceptions")
    if boto is None:
        return (), (), ()
    return ((boto.NoCredentialsError, boto.PartialCredentialsError, boto.CredentialRetrievalError),
            (boto.EndpointConnectionError, boto.ConnectTimeoutError), (boto.BotoCoreError,))


def _store_refusal(error: BaseException) -> tuple[str, BaseException] | None:
    """What a remote store refused, from the error's chain: ("no credentials" | "credentials" |
    "bucket" | "unreachable" | "not found", the cause); None for any other error."""
    no_credentials, unreachable, _ = _botocore_errors()
    chain = _causes(error)
    for cause in chain:
        code = _error_code(cause)
        if code in _NO_BUCKET_CODES:
            return "bucket", cause
        if code in _CREDENTIAL_CODES:
            return "credentials", cause
        if isinstance(cause, no_credentials):
            return "no credentials", cause
        if isinstance(cause, unreachable):
            return "unreachable", cause
    for cause in chain:
        if isinstance(cause, PermissionError) and cause.errno is None:  # not a local file's
            return "credentials", cause
        if isinstance(cause, FileNotFoundError):
            return "not found", cause
    return None


def _missing_bucket(urls: list[str],
                    storage_options: dict[str, Any] | None) -> tuple[str, str] | None:
    """(url, bucket) for the first of `urls` whose bucket does not exist; None if all exist."""
    _, _, store_errors = _botocore_errors()  # loaded with the store's client, if at all
    for url in urls:
        if url.partition("://")[0] not in BUCKET_SCHEMES:
            continue
        fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
        try:
            bucket = missing_bucket(fs, url)
        except (OSError, *store_errors):  # the store would not say: the bucket may well exist
            continue
        if bucket is not None:
            return url, bucket
    return None


def _named_url(error: BaseException, urls: list[str]) -> str | None:
    """The URL the error is about: the first of `urls` the chain's messages mention, else the
    first of them (None without a remote URL)."""
    text = " ".join(str(cause) for cause in _causes(error))
    for url in urls:
        where = re.split(r"[*?\[{]", url.partition("://")[2])[0].rstrip("/")
        if where and where in text:
            return url
    return urls[0] if urls else None


def _no_bucket_message(url: str, bucket: str, writing: bool) -> str:
    endpoint = _endpoint_option(url)
    return (f"{url}: bucket {bucket!r} does not exist; {'create it first, or ' if writing else ''}"
            "check the URL" + (f" (and, for a store other than AWS, its endpoint: {endpoint})"
                               if endpoint else ""))
