"""Anthropic's Messages API (docs/MESSAGES.md): its requests, their chat form, its message and
event stream, and its dialect (errors, key header), over the one pipeline."""
