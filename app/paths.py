"""Where the app keeps its files: settings in the user config folder, conversations, attachments and
logs in the user data folder. `SLIPSTREAM_CONFIG_DIR` / `SLIPSTREAM_DATA_DIR` override them (tests,
portable installs)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from app import APP_NAME


def config_dir() -> Path:
    override = os.environ.get("SLIPSTREAM_CONFIG_DIR")
    path = Path(override) if override else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    override = os.environ.get("SLIPSTREAM_DATA_DIR")
    path = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def settings_file() -> Path:
    return config_dir() / "settings.json"


def conversations_db() -> Path:
    return data_dir() / "conversations.sqlite3"


def attachments_dir() -> Path:
    path = data_dir() / "attachments"
    path.mkdir(parents=True, exist_ok=True)
    return path


def worker_log() -> Path:
    path = data_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path / "worker.log"
