"""The kvpilot inference engine: paged KV cache, continuous batching, OpenAI-compatible server."""
