"""Fixtures shared by every test suite.

Triton kernels run on the CPU through Triton's interpreter unless a GPU run
asks otherwise (KVPILOT_TEST_DEVICE=cuda); the flag must be set before any
kernel module is imported, which is why it is set here, at collection time.
"""

from __future__ import annotations

import os

if os.environ.get("KVPILOT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
