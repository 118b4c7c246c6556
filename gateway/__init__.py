"""The HTTP edge: an OpenAI-compatible Starlette app over the in-process engine, and its CLI.

`gateway.app.create_app(settings, engine=...)` builds the app; `batchgate serve` (gateway.cli) runs it.
"""
