"""kvpilot: LLM inference on Kubernetes.

The components are subpackages: ``kvpilot.engine`` (inference engine and
OpenAI-compatible server), ``kvpilot.kernels`` (Triton kernels),
``kvpilot.operator`` (the kopf operator) and ``kvpilot.localcluster`` (a local
Kubernetes control plane for tests and the demo).
"""

__version__ = "0.1.0"
