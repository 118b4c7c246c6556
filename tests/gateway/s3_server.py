"""moto's S3 server as a real subprocess on a free port, with a bucket, for the Files API's bucket
tests; the AWS_* variables boto3 reads are set while it runs (gateways started then inherit them)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.conftest_redis import free_port

BUCKET = "batchgate-files"


@contextlib.contextmanager
def moto_server(workdir: Path, bucket: str = BUCKET) -> Iterator[str]:
    """The server's URL, `bucket` created in it."""
    port = free_port()
    log = workdir / "moto.log"
    server = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(server), "-p", str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    saved = {
        k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, f"moto did not start:\n{log.read_text()}"
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
