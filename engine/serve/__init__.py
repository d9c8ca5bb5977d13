"""The local OpenAI-compatible HTTP API (`python -m engine serve`, or inside the app's worker).

`auth` (the key and its check), `gate` (one generation at a time, first come first served),
`body` (reading request bodies), `openai_schema` (request validation), `responses` (OpenAI objects),
`runner` (the engine behind the gate), `handler` (HTTP), `server` (`ApiServer`), `errors`.
"""

from engine.serve.runner import EngineSlot
from engine.serve.server import DEFAULT_PORT, ApiServer

__all__ = ["DEFAULT_PORT", "ApiServer", "EngineSlot"]
