"""The gateway's settings: built once from the command line, validated here, then frozen."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot import gateway_contract as contract


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "0.0.0.0"
    port: int = contract.GATEWAY_PORT
    prefix_chars: int = 256  # characters of the prompt that prefix affinity follows; 0 turns it off
    load_factor: float = 1.5  # a pod may carry this many times the mean load before its prefixes spill
    scrape_interval_seconds: float = 1.0  # how often the engines' load gauges are read
    max_held_requests: int = 256  # per model, waiting for a Ready pod; more get 503 at once
    hold_timeout_seconds: float = 300.0  # longest a request waits for a Ready pod before a 503
    retry_after_seconds: int = 5  # what a 503 for a held request tells the client
    max_body_bytes: int = 32 << 20
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        checks = (
            (0 < self.port < 65536, f"--port must be 1..65535, got {self.port}"),
            (self.prefix_chars >= 0, f"--prefix-chars must be 0 (off) or more, got {self.prefix_chars}"),
            (self.load_factor >= 1.0, f"--load-factor must be at least 1 (the mean load), got {self.load_factor}"),
            (self.scrape_interval_seconds > 0, "--scrape-interval must be positive"),
            (self.max_held_requests >= 0, "--max-held-requests must be 0 (never hold) or more"),
            (self.hold_timeout_seconds > 0, "--hold-timeout must be positive"),
            (self.retry_after_seconds >= 1, "--retry-after must be at least 1 second"),
            (self.max_body_bytes >= 1024, "--max-body-bytes must be at least 1024"),
            (self.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), "--log-level must be DEBUG, INFO, WARNING or ERROR"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
