"""Fixtures for the app's tests: private data/config folders, an in-memory keyring, a tiny model folder,
and a running `AppController` whose engine worker is a real `python -m engine worker` process."""

from __future__ import annotations

import os
import shutil

import keyring
import pytest

from tests.app.memory_keyring import MemoryKeyring

WORKER_PACE_MS = 40     # slow the tiny model's stream so a test can watch it and stop it mid-answer


@pytest.fixture(autouse=True)
def app_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SLIPSTREAM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    return tmp_path


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny_models import tiny_model_cache

    dest = tmp_path_factory.mktemp("models") / "tiny-llama"
    shutil.copytree(tiny_model_cache("llama"), dest)
    return dest


@pytest.fixture
def controller(qtbot, tiny_model_dir, memory_keyring):
    """The app on the tiny model, device "sim" (placement and budgets as on a GPU), real worker process."""
    from app.controller import AppController, LaunchOptions
    from app.worker_client import default_worker_command

    options = LaunchOptions(show_chat=True, model=str(tiny_model_dir), device="sim", backend="torch",
                            worker_command=default_worker_command(pace_ms=WORKER_PACE_MS), start_monitor=False)
    ctl = AppController(options)
    ctl.settings.temperature = 0.0
    ctl.settings.max_new_tokens = 120
    qtbot.addWidget(ctl.window)
    ctl.start()
    qtbot.waitUntil(lambda: ctl.worker.state == "loaded", timeout=90_000)
    yield ctl
    ctl.quit()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
