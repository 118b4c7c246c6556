"""Settings: flags over BATCHGATE_* variables over defaults; sizes with suffixes; early, named errors."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SchedulerConfig
from gateway import cli
from gateway.settings import DEFAULT_MAX_BODY_BYTES, Settings, option_specs, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000", 1000),
        ("2GiB", 2 * 1024**3),
        ("2Gi", 2 * 1024**3),
        ("512MB", 512_000_000),
        ("1.5 KiB", 1536),
        ("4mib", 4 * 1024**2),
        ("10B", 10),
        ("1T", 10**12),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "-1", "0", "1iB", "two"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_defaults() -> None:
    s = Settings.load({}, {})
    assert (s.host, s.port, s.model, s.max_body_bytes, s.keep_alive_s) == (
        "127.0.0.1",
        8000,
        None,
        DEFAULT_MAX_BODY_BYTES,
        15.0,
    )
    cfg = s.engine_config()
    assert cfg.model.model is None and cfg.cache.block_size == 16
    assert s.engine_stall_timeout_s == 60.0
    assert s.drain_timeout_s == 60.0
    assert Settings.load({}, {"BATCHGATE_DRAIN_TIMEOUT": "2.5"}).drain_timeout_s == 2.5


def test_engine_defaults_have_one_source() -> None:
    # Unset flags give exactly EngineConfig's defaults, and the scheduler starts from the same ones.
    assert Settings.load({}, {}).engine_config() == EngineConfig()
    assert EngineConfig().scheduler == SchedulerConfig()


def test_flag_over_env_over_default() -> None:
    env = {
        "BATCHGATE_PORT": "9001",
        "BATCHGATE_KV_CACHE_MEMORY": "1GiB",
        "BATCHGATE_KEEP_ALIVE": "2.5",
        "BATCHGATE_MAX_NUM_SEQS": "8",
        "BATCHGATE_SERVED_MODEL_NAME": "",
        "OTHER": "x",
    }
    s = Settings.load({"port": 9002, "max_num_seqs": None}, env)
    assert s.port == 9002  # the flag wins
    assert s.kv_cache_memory_bytes == 1024**3 and s.keep_alive_s == 2.5 and s.max_num_seqs == 8
    assert s.served_model_name is None  # empty variable = unset
    cfg = s.engine_config()
    assert cfg.cache.kv_cache_memory_bytes == 1024**3 and cfg.scheduler.max_num_seqs == 8
    s = Settings.load({"queue_deadline_s": 2.5}, {"BATCHGATE_NUM_THREADS": "2"})
    cfg = s.engine_config()
    assert cfg.scheduler.default_queue_deadline_s == 2.5 and cfg.model.num_threads == 2


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ({"BATCHGATE_PORT": "eighty"}, "BATCHGATE_PORT"),
        ({"BATCHGATE_PORT": "70000"}, "port"),
        ({"BATCHGATE_BLOCK_SIZE": "12"}, "block_size"),
        ({"BATCHGATE_DTYPE": "int3"}, "dtype"),
        ({"BATCHGATE_REDIS_POLICY": "maybe"}, "redis_policy"),
        ({"BATCHGATE_KEEP_ALIVE": "0"}, "keep_alive_s"),
        ({"BATCHGATE_ENGINE_STALL_TIMEOUT": "0"}, "engine_stall_timeout_s"),
        ({"BATCHGATE_KEEP_ALIVE": "nan"}, "BATCHGATE_KEEP_ALIVE"),
        ({"BATCHGATE_MAX_BODY_BYTES": "lots"}, "BATCHGATE_MAX_BODY_BYTES"),
        ({"BATCHGATE_QUEUE_DEADLINE": "-1"}, "default_queue_deadline_s"),
        ({"BATCHGATE_KV_CACHE_MEMORY_FRACTION": "2"}, "kv_cache_memory_fraction"),
        ({"BATCHGATE_DRAIN_TIMEOUT": "-1"}, "drain_timeout_s"),
    ],
)
def test_bad_settings_fail_early_naming_the_setting(env: dict[str, str], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        Settings.load({}, env)


def test_every_setting_has_a_flag_and_variable() -> None:
    specs = {s.name: (s.flag, s.env) for s in option_specs()}
    assert specs["kv_cache_memory_bytes"] == ("--kv-cache-memory", "BATCHGATE_KV_CACHE_MEMORY")
    assert specs["keep_alive_s"] == ("--keep-alive", "BATCHGATE_KEEP_ALIVE")
    assert specs["max_num_batched_tokens"] == ("--max-num-batched-tokens", "BATCHGATE_MAX_NUM_BATCHED_TOKENS")
    assert specs["queue_deadline_s"] == ("--queue-deadline", "BATCHGATE_QUEUE_DEADLINE")
    assert specs["engine_stall_timeout_s"] == ("--engine-stall-timeout", "BATCHGATE_ENGINE_STALL_TIMEOUT")
    for name in (
        "host",
        "port",
        "model",
        "served_model_name",
        "dtype",
        "device",
        "block_size",
        "max_num_seqs",
        "max_model_len",
        "max_body_bytes",
        "tenants",
        "redis_url",
        "redis_policy",
    ):
        assert specs[name][1] == "BATCHGATE_" + name.upper()


def test_cli_parses_serve_flags_and_runs_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    monkeypatch.setattr(
        cli, "serve", lambda settings, tenancy: seen.update(settings=settings, tenancy=tenancy) or 0
    )
    rc = cli.main(
        ["serve", "--port", "0", "--kv-cache-memory", "64MiB", "--dtype", "float32"],
        environ={"BATCHGATE_HOST": "0.0.0.0"},
    )
    assert rc == 0
    s = seen["settings"]
    assert (s.port, s.host, s.kv_cache_memory_bytes, s.dtype) == (0, "0.0.0.0", 64 * 1024**2, "float32")
    assert seen["tenancy"] is None  # open mode


def test_cli_reports_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--model", "/no/such/model"], environ={}) == 2
    assert "/no/such/model" in capsys.readouterr().err
    assert cli.main(["serve"], environ={"BATCHGATE_BLOCK_SIZE": "3"}) == 2
    with pytest.raises(SystemExit):
        cli.main(["serve", "--kv-cache-memory", "lots"], environ={})
    assert "expected a size" in capsys.readouterr().err


def test_cli_has_tenancy_subcommands() -> None:
    parser = cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "serve" in choices
    pytest.importorskip("tenancy.cli")
    assert {"keys", "usage"} <= set(choices)


def test_cli_builds_tenancy_from_a_tenants_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    tenancy = pytest.importorskip("tenancy")
    seen = {}
    monkeypatch.setattr(cli, "serve", lambda settings, tenancy: seen.update(tenancy=tenancy) or 0)
    good = tmp_path / "tenants.toml"
    good.write_text(
        '[plans.p]\npriority = "paid"\ntokens_per_minute = 10\nrequests_per_minute = 1\n'
        'max_concurrent_requests = 1\nqueue_deadline_seconds = 1\n[tenants.a]\nplan = "p"\n'
    )
    assert cli.main(["serve", "--tenants", str(good), "--internal-token", "t"], environ={}) == 0
    assert isinstance(seen["tenancy"], tenancy.Tenancy) and not seen["tenancy"].open_mode

    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.a]\nplan = 'nosuch'\n")
    assert cli.main(["serve"], environ={"BATCHGATE_TENANTS": str(bad)}) == 2
    err = capsys.readouterr().err
    assert err.startswith("batchgate: error:") and "plan" in err
