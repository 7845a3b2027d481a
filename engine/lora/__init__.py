"""LoRA adapters served on top of one base model (see adapter.py, layer.py, manager.py)."""

from kvpilot.engine.lora.adapter import LoRAAdapter, LoRAError, LoRARequest

__all__ = ["LoRAAdapter", "LoRAError", "LoRARequest"]
