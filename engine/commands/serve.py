"""`python -m engine serve --port N [--model PATH]`: the OpenAI-compatible API on 127.0.0.1.

Binds the port first (a port in use fails at once), then opens the model; requests that arrive while it
loads get a 503. Prints the address and where the key comes from; the key itself only with --show-key.
Ctrl-C stops the server (running generations are cancelled) and closes the model.
"""

from __future__ import annotations

import argparse
import sys

from engine.commands.common import add_model_arguments
from engine.serve.server import DEFAULT_MAX_BODY, DEFAULT_PORT

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--show-key", action="store_true", help="print the API key at start")
    p.add_argument("--max-body-mib", type=float, default=DEFAULT_MAX_BODY / (1 << 20),
                   help="largest request body accepted, in MiB (default 32)")
    p.add_argument("--quiet", action="store_true", help="do not log each request to stderr")
    add_model_arguments(p)


def run(args) -> int:
    from engine.commands.common import open_from_args
    from engine.errors import SlipstreamError
    from engine.serve.auth import resolve_api_key
    from engine.serve.runner import EngineSlot
    from engine.serve.server import ApiServer

    if not 0 <= args.port <= 65535:
        raise SlipstreamError(f"--port={args.port}: expected 0 to 65535")
    key, source = resolve_api_key()
    holder: dict = {"engine": None}
    slot = EngineSlot(lambda: holder["engine"])
    slot.not_ready_message = "the model is still loading; try again in a moment"
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    server = ApiServer(slot, key, host=args.host, port=args.port, max_body=int(args.max_body_mib * (1 << 20)),
                       log=log)
    address = server.start()
    print(f"Slipstream API on {address} (OpenAI-compatible: /chat/completions, /completions, /models)",
          flush=True)
    if args.host not in _LOOPBACK:
        print(f"warning: bound to {args.host}, reachable from other machines; anyone with the key can use it",
              file=sys.stderr, flush=True)
    print(f"API key: from {source}" + (f": {key}" if args.show_key else " (--show-key prints it)"), flush=True)
    try:
        print(f"loading {args.model or 'the bundled default model'}…", flush=True)
        engine = open_from_args(args)
        holder["engine"] = engine
        print(f"ready: model {slot.model_name()} ({engine.backend} on {getattr(engine, 'device', args.device)}, "
              f"context {engine.context_length}); Ctrl-C stops", flush=True)
        server.serve_until_interrupted()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        engine, holder["engine"] = holder["engine"], None
        if engine is not None:
            engine.close()
    return 0
