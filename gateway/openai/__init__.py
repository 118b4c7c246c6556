"""OpenAI's protocol for chat, completions and embeddings: the request types, the response shapes
and the builders of bodies and SSE streams, the tokenizer's prompt rendering, tool calling, and the
endpoints themselves. The other families render into its chat form."""
