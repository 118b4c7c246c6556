"""Where the bytes of uploaded files and batch outputs live: one small interface, a directory
backend (the default: `--storage-dir`/files, a volume in Helm) and an S3-compatible bucket
(`--files-bucket`).

    Blobs.put(key, data) / get(key) -> bytes | None / delete(key) / aclose()

Keys are the file ids (`file-<hex>`), already scoped to a tenant by the metadata in
gateway/batches/store.py: a blob is reached only through its tenant's record. A write is atomic
(a temporary file renamed into place), so a crash never leaves half a file under its id.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol

import anyio

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class Blobs(Protocol):
    """Bytes by key. Contract: `put` is atomic (a reader sees all or nothing); `get` of an unknown
    key is None; `delete` of an unknown key is a no-op."""

    async def put(self, key: str, data: bytes) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def delete(self, key: str) -> None: ...

    async def aclose(self) -> None: ...


class DirectoryBlobs:
    """Files in one directory (created if missing); calls run in a worker thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key

    def _put(self, key: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    async def put(self, key: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._put, key, data)

    async def get(self, key: str) -> bytes | None:
        return await anyio.to_thread.run_sync(self._get, key)

    async def delete(self, key: str) -> None:
        await anyio.to_thread.run_sync(lambda: self._path(key).unlink(missing_ok=True))

    async def aclose(self) -> None:
        return None


class S3Blobs:
    """Objects in an S3-compatible bucket (`--files-bucket s3://<bucket>[/<prefix>]`; MinIO or any
    other S3 API with `--s3-endpoint-url`), so several gateways read the same files. Credentials
    and region come from boto3's usual sources (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_DEFAULT_REGION, an instance role). A PUT is atomic in S3. Calls run in a worker thread."""

    def __init__(self, url: str, endpoint_url: str | None = None) -> None:
        import boto3

        if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
            raise ValueError(f"expected s3://<bucket>[/<prefix>], got {url!r}")
        bucket, _, prefix = url[5:].partition("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._s3: Any = boto3.client("s3", endpoint_url=endpoint_url)

    def _key(self, key: str) -> str:
        if not _KEY.match(key):
            raise ValueError(f"invalid blob key {key!r}")
        return self.prefix + key

    def _get(self, key: str) -> bytes | None:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self._s3.exceptions.NoSuchKey:
            return None
        return bytes(body.read())

    async def put(self, key: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(
            lambda: self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        )

    async def get(self, key: str) -> bytes | None:
        return await anyio.to_thread.run_sync(self._get, key)

    async def delete(self, key: str) -> None:
        await anyio.to_thread.run_sync(lambda: self._s3.delete_object(Bucket=self.bucket, Key=self._key(key)))

    async def aclose(self) -> None:
        self._s3.close()
