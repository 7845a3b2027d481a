"""The kvpilot gateway: one OpenAI-compatible front door, routing by model, load and prompt prefix."""
