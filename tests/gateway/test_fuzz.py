"""Schema-driven fuzzing with schemathesis against /openapi.json of a real server (tiny model).

For every operation in the document, hypothesis draws positive (schema-valid) and negative
(schema-breaking) cases; no response may be a 5xx, and every response must match the document
(status, content type, body schema), and a schema-breaking body must be refused.
`positive_data_acceptance` is off on purpose: the server rightly refuses some schema-valid bodies
for reasons a schema cannot say (prompt + max_tokens beyond the context, top_logprobs without
logprobs, token ids outside the vocabulary, ...), each with a 400 that names the field.

Generated bodies keep max_tokens and n small (only values the schema allows are lowered, and an
absent max_tokens is set), so a case costs milliseconds of generation, not seconds.
(schemathesis's own pytest plugin, `from_fixture(...).parametrize()`, fails under pytest 9 with
"'Function' object has no attribute '_nodeid'", hence hypothesis driven by hand.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.gateway.conftest import TinyServer

MAX_TOKENS_CAP = 4
N_CAP = 2
# Examples per operation and mode: POST operations get the most, the GETs have little to vary.
MAX_EXAMPLES = {"POST": 150, "GET": 15, "DELETE": 15}
# The Responses, Conversations, Files and Batches APIs' operations share one parser and store each:
# fewer examples each, to keep the run short.
RESPONSES_MAX_EXAMPLES = {"POST": 30, "GET": 5, "DELETE": 5}
# The admin routes answer this server (no admin key configured) with the documented 401 before
# reading a body: a few examples each show that, and none in the negative mode.
ADMIN_MAX_EXAMPLES = {"POST": 2, "PUT": 2, "GET": 2, "DELETE": 2}


def _is_int(value: Any) -> bool:
    return type(value) is int or (type(value) is float and value.is_integer())


def _cap_costs(body: Any, path: str = "") -> None:
    if not isinstance(body, dict):
        return
    if path.startswith("/v1/responses"):
        # Only a schema-valid value is lowered (or an absent one set): a negative case's broken
        # value must reach the server as drawn, or the server is blamed for accepting it.
        value = body.get("max_output_tokens")
        if value is None or (_is_int(value) and value > MAX_TOKENS_CAP):
            body["max_output_tokens"] = MAX_TOKENS_CAP
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if _is_int(body.get(key)) and body[key] > MAX_TOKENS_CAP:
            body[key] = MAX_TOKENS_CAP
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP  # else 16 (completions) or all the context left (chat)
    for key in ("n", "best_of"):
        if _is_int(body.get(key)) and N_CAP < body[key] <= 128:
            body[key] = N_CAP


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(tiny_server: TinyServer, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(tiny_server.base_url + "/openapi.json")
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
    }
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and (operation.method.upper() != "POST" or not operation.body):
            continue  # a GET, or a POST without a body (cancel), has nothing to break
        if mode is GenerationMode.NEGATIVE and operation.label == "POST /v1/files":
            continue  # a multipart form carries only strings and bytes: no value breaks its types
        admin = operation.path.startswith("/admin/")
        if mode is GenerationMode.NEGATIVE and admin:
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=(
                ADMIN_MAX_EXAMPLES
                if admin
                else RESPONSES_MAX_EXAMPLES
                if operation.path.startswith(
                    ("/v1/responses", "/v1/conversations", "/v1/files", "/v1/batches")
                )
                else MAX_EXAMPLES
            )[operation.method.upper()],
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            _cap_costs(case.body, case.path)
            response = case.call_and_validate(
                base_url=tiny_server.base_url, excluded_checks=[positive_data_acceptance], timeout=60
            )
            statuses[response.status_code] += 1

        run()
    print(mode, sorted(statuses.items()))
    assert not any(status >= 500 for status in statuses), statuses
    if mode is GenerationMode.POSITIVE:
        assert statuses[200] >= 50, statuses  # the fuzzer really reached the engine
    tiny_server.wait_idle()
