"""The app's side: Settings turn the API on and off, and show its address as the worker reports it, and
its key (from the keyring, masked, with Copy); an OpenAI client then talks to the app's own engine."""

from __future__ import annotations

import keyring
import openai
import pytest
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QLineEdit

from app import paths
from tests.app.memory_keyring import MemoryKeyring
from tests.serve.conftest import free_port

TIMEOUT = 90_000


@pytest.fixture
def app_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SLIPSTREAM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("SLIPSTREAM_API_KEY", raising=False)
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def test_settings_show_the_api_address_when_the_worker_reports_it(qtbot, app_env, tiny_model):
    from app.controller import AppController, LaunchOptions
    from app.secret_store import API_KEY

    ctl = AppController(LaunchOptions(model=str(tiny_model("llama")), device="cpu", backend="torch",
                                      start_monitor=False))
    qtbot.addWidget(ctl.window)
    ctl.start()
    dialog = ctl.settings_dialog()
    qtbot.addWidget(dialog)
    assert dialog.api_address.text() == "off" and not dialog.api_enabled.isChecked()
    assert not dialog.copy_address.isEnabled()

    port = free_port()
    dialog.api_enabled.setChecked(True)
    dialog.api_port.setValue(port)
    assert dialog.save_secrets() is None
    with qtbot.waitSignal(ctl.worker.apiStatus, timeout=TIMEOUT):
        ctl.apply_settings(dialog.result_settings())
    address = f"http://127.0.0.1:{port}/v1"
    qtbot.waitUntil(lambda: dialog.api_address.text() == address, timeout=TIMEOUT)
    assert dialog.copy_address.isEnabled()
    dialog.copy_address.click()
    assert QGuiApplication.clipboard().text() == address

    key = app_env.store[("Slipstream", API_KEY)]                  # created in the keyring on first use
    reopened = ctl.settings_dialog()
    qtbot.addWidget(reopened)
    assert reopened.api_address.text() == address and reopened.api_enabled.isChecked()
    assert reopened.api_key.text() == key and reopened.api_key.echoMode() == QLineEdit.EchoMode.Password
    reopened.copy_key.click()
    assert QGuiApplication.clipboard().text() == key
    reopened.show_key.click()
    assert reopened.api_key.echoMode() == QLineEdit.EchoMode.Normal

    qtbot.waitUntil(lambda: ctl.worker.state == "loaded", timeout=TIMEOUT)
    client = openai.OpenAI(api_key=key, base_url=address, max_retries=0, timeout=120)
    # (seeded: the tiny random model's sampling could draw its end-of-sequence token within 4 tokens)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       seed=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    saved = paths.settings_file().read_text(encoding="utf-8")
    assert '"api_enabled": true' in saved and key not in saved    # the key stays in the keyring

    settings = reopened.result_settings()
    settings.api_enabled = False
    with qtbot.waitSignal(ctl.worker.apiStatus, timeout=TIMEOUT):
        ctl.apply_settings(settings)
    qtbot.waitUntil(lambda: dialog.api_address.text() == "off", timeout=TIMEOUT)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    ctl.quit()
