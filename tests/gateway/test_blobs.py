"""The blob stores under the Files API: the storage directory, and an S3-compatible bucket (moto's
server mode as a real subprocess, spoken to over HTTP by boto3), behind one contract; and a
gateway whose files live in the bucket."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.app import create_app
from gateway.batches.blobs import Blobs, DirectoryBlobs, S3Blobs
from gateway.settings import Settings
from tests.gateway.conftest import LiveServer
from tests.gateway.fakes import FakeEngine
from tests.gateway.s3_server import BUCKET, moto_server


@pytest.fixture(scope="module")
def s3_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture(params=["directory", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: Path) -> Blobs:
    if request.param == "directory":
        return DirectoryBlobs(tmp_path / "files")
    return S3Blobs(f"s3://{BUCKET}/prefix", request.getfixturevalue("s3_url"))


def test_the_contract(blobs: Blobs) -> None:
    async def run() -> None:
        assert await blobs.get("file-missing") is None
        await blobs.put("file-a", b"one\ntwo\n")
        await blobs.put("file-b", b"")
        assert await blobs.get("file-a") == b"one\ntwo\n" and await blobs.get("file-b") == b""
        await blobs.put("file-a", b"replaced")
        assert await blobs.get("file-a") == b"replaced"
        await blobs.delete("file-a")
        await blobs.delete("file-a")  # a no-op
        assert await blobs.get("file-a") is None
        with pytest.raises(ValueError, match="invalid blob key"):
            await blobs.put("../escape", b"x")
        await blobs.aclose()

    asyncio.run(run())


def test_a_gateway_keeps_its_files_in_the_bucket(s3_url: str, tmp_path: Path) -> None:
    import boto3

    settings = Settings(
        storage_dir=str(tmp_path),
        files_bucket=f"s3://{BUCKET}/gw",
        s3_endpoint_url=s3_url,
        embedding_model="none",
    )
    server = LiveServer(create_app(settings, engine=FakeEngine()))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        upload = client.files.create(file=("notes.txt", io.BytesIO(b"in the bucket")), purpose="user_data")
        assert client.files.content(upload.id).content == b"in the bucket"
        s3: Any = boto3.client("s3", endpoint_url=s3_url)
        assert s3.get_object(Bucket=BUCKET, Key=f"gw/{upload.id}")["Body"].read() == b"in the bucket"
        assert not (tmp_path / "files" / upload.id).exists()
        client.files.delete(upload.id)
        assert s3.list_objects_v2(Bucket=BUCKET, Prefix=f"gw/{upload.id}").get("KeyCount") == 0
    finally:
        server.stop()
