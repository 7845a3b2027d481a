"""The kvpilot Kubernetes operator (kopf)."""
