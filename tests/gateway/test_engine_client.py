"""The gateway's stand-in engine keeps to the interface the gateway is typed against."""

from __future__ import annotations

from engine.client import EngineClient, EngineStream
from engine.types import GenerationRequest, SamplingParams
from tests.gateway.fakes import FakeEngine


def test_the_fake_engine_and_its_streams_implement_the_engine_client() -> None:
    engine = FakeEngine()
    assert isinstance(engine, EngineClient)
    stream = engine.submit(GenerationRequest("r", [1, 2], SamplingParams(max_tokens=2)))
    assert isinstance(stream, EngineStream)
