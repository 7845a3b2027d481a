"""Fixtures of the operator's tests."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest


@pytest.fixture(scope="module")
def engine_metrics_page() -> str:
    """An engine's /metrics page, from the server's real registry over real engine stats."""
    from kvpilot.engine import EngineStats
    from kvpilot.engine.server.metrics import ServerMetrics

    stats = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.4, kv_utilization=0.9, num_kv_blocks=512,
                        preemptions_total=0, prefix_cache_queries_total=10, prefix_cache_hits_total=4,
                        prompt_tokens_total=100, generation_tokens_total=300, steps_total=50,
                        step_running_seqs_total=140, max_num_seqs=16, max_num_batched_tokens=256)
    metrics = ServerMetrics(model_name="tiny", stats=lambda: stats, num_waiting=lambda: 1,
                            gpu_memory_utilization=0.9, model_info={"architecture": "LlamaForCausalLM"})
    return generate_latest(metrics.registry).decode()
