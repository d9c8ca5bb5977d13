"""`python -m engine worker`: run as the app's engine worker (JSON lines on stdin/stdout, docs/PROTOCOL.md)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="wait this long after each streamed token (demos and tests; default 0)")
    parser.add_argument("--metrics-interval", type=float, default=0.25, metavar="SECONDS",
                        help="how often to send a metrics event while a model is loaded (default 0.25)")


def run(args: argparse.Namespace) -> int:
    from engine.worker import serve_stdio

    return serve_stdio(pace_s=max(0.0, args.pace_ms) / 1000.0, metrics_interval_s=max(0.05, args.metrics_interval))
