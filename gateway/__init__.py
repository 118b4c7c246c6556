"""The HTTP edge: an OpenAI-compatible Starlette app over in-process engines or remote replicas.

`gateway.app.create_app(settings, engine=...)` builds the app; `batchgate serve` (gateway.cli) runs
it. The core is this package's modules: the settings, the one request pipeline (pipeline.py) over
the backend seam (backend.py), the endpoint table (endpoints.py), the model registry, tenant
admission, errors, SSE, drain, metrics and traces. Each API family or mode is a sub-package:

    openai/     chat, completions and embeddings: request types, response shapes, tool calling
    responses/  the Responses API and Conversations, their stored state
    batches/    the Batch and Files APIs, and the runner of a batch's lines
    local/      in-process mode: the generation engine and embedding batcher backends
    pool/       pool mode: the replica registry, routing, the relay backend
    admin/      the admin API, the usage ledger over HTTP, the budget webhook
    openapi/    the OpenAPI document

The floors between them are pyproject.toml's import contracts (`make lint`).
"""
