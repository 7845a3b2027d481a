"""The OpenAI-compatible HTTP server around ``LLMEngine``.

protocol.py holds the wire models, serving.py turns requests into engine calls
and engine outputs into responses, async_engine.py runs the engine on its own
thread, metrics.py exports Prometheus metrics and api_server.py routes HTTP.
"""
