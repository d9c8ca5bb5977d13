"""Slipstream's tray app (PySide6). It never imports torch or the engine: the engine runs in a worker
process (`python -m engine worker`) that the app drives through the protocol in docs/PROTOCOL.md."""

APP_NAME = "Slipstream"
__version__ = "0.1.0"
