"""The kvpilot gateway over a fixed list of engines, for benchmarks/routing.py (no Kubernetes).

    python benchmarks/routing_gateway.py --port P --model NAME --backend http://127.0.0.1:A --backend ...

It is the gateway's own app (kvpilot.gateway.server.build_app) with a route table written
once instead of watched: the same picking, load scrape and proxying as in a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from kvpilot.gateway.discovery import RouteTable
from kvpilot.gateway.routes import Backend, Route
from kvpilot.gateway.server import build_app, start
from kvpilot.gateway.settings import GatewaySettings


async def serve(port: int, model: str, backends: list[str], prefix_chars: int, load_factor: float) -> None:
    table = RouteTable()
    table.synced = True
    table.set({model: Route(model, "bench", model, len(backends),
                            tuple(Backend(f"bench/engine-{i}", url) for i, url in enumerate(backends)),
                            "2026-01-01T00:00:00Z")})
    settings = GatewaySettings(host="127.0.0.1", port=port, prefix_chars=prefix_chars, load_factor=load_factor)
    runner = await start(build_app(settings, table), settings.host, settings.port, shutdown_seconds=2.0)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--prefix-chars", type=int, default=GatewaySettings().prefix_chars)
    parser.add_argument("--load-factor", type=float, default=GatewaySettings().load_factor)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.model, args.backend, args.prefix_chars, args.load_factor))


if __name__ == "__main__":
    main()
