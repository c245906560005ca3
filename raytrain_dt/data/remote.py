"""Data on object storage: `s3://` URIs for `data.path` and `data.source`, through pyarrow's
S3 filesystem.

The filesystem is configured only by the standard AWS variables (credentials through the AWS
SDK's own chain: the environment, a profile, the instance role; `AWS_ENDPOINT_URL` and the
region as pyarrow does not read them itself), so it is made afresh in each process that reads:
on the driver, which only lists files and reads parquet footers to plan, and in Ray Data's
tasks, which read the bytes. A URI that cannot be used is refused with one line naming the
config key (`DataError`: exit code 2).
"""

from __future__ import annotations

import fnmatch
import os

import pyarrow.fs as pafs

from raytrain_dt.errors import DataError, UserError

SCHEME = "s3://"


def is_remote(uri: str | os.PathLike) -> bool:
    return str(uri).startswith(SCHEME)


def s3_filesystem() -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem as the AWS variables of this process describe it."""
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_override"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return pafs.S3FileSystem(**options)


def bucket_path(uri: str) -> str:
    """`bucket/key` of an `s3://` URI, as pyarrow's filesystem names it."""
    return str(uri)[len(SCHEME) :].rstrip("/")


def check_credentials(uri: str, key: str, error: type[UserError] = DataError) -> None:
    """Refuse `uri` (config `key`: data here, `checkpoint.dir` for the coordinator, which
    raises its own `error`) when it is on S3 and no AWS credentials are reachable from here:
    the S3 clients would otherwise fail later, per request, with a message naming neither."""
    if not is_remote(uri):
        return
    try:
        import botocore.session
    except ImportError:  # no AWS SDK for Python to ask: pyarrow's own chain decides
        return
    if botocore.session.get_session().get_credentials() is None:
        raise error(
            f"{key}: {uri}: no AWS credentials reachable (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or use an instance role)"
        )


def list_files(uri: str, key: str) -> dict[str, tuple[int, int]]:
    """{`s3://` URI: (size, mtime in ns)} of the files at or below `uri` (a file, a prefix, or
    a glob pattern), sorted by name; on the driver, a listing only. Hidden and
    underscore-prefixed names are skipped."""
    check_credentials(uri, key)
    fs, path = s3_filesystem(), bucket_path(uri)
    pattern = None
    if any(c in path for c in "*?["):
        # pyarrow lists, it does not glob: list below the pattern's fixed directory.
        pattern, path = path, path[: min(path.find(c) for c in "*?[" if c in path)]
        path = path.rsplit("/", 1)[0]
    try:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            found = [info]
        else:
            found = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    except OSError as exc:  # access denied, no such bucket, endpoint unreachable
        raise DataError(f"{key}: {uri}: {str(exc).splitlines()[0]}") from exc
    listed = {
        SCHEME + f.path: (int(f.size), int(f.mtime_ns or 0))
        for f in found
        if f.type == pafs.FileType.File
        and not f.base_name.startswith(("_", "."))
        and (pattern is None or fnmatch.fnmatchcase(f.path, pattern))
    }
    return dict(sorted(listed.items()))
