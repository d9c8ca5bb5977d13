"""Settings round-trip through the config file; secrets live in the keyring (a test backend), never in it."""

from __future__ import annotations

import json

import pytest

from app import paths
from app.secret_store import API_KEY, HF_TOKEN, SecretStore, SecretStoreError
from app.settings import Settings, load_settings, save_settings


def test_settings_round_trip():
    path = paths.settings_file()
    assert path.parent == paths.config_dir()
    s = Settings(model_source="/models/x.gguf", device="sim", budget_mode="fixed", budget_cap=3 << 30,
                 temperature=0.2, system_prompt="Be brief.", extra_model_dirs=["/a", "/b"])
    save_settings(s, path)
    loaded, problems = load_settings(path)
    assert problems == []
    assert loaded == s


def test_missing_file_gives_defaults():
    loaded, problems = load_settings(paths.config_dir() / "absent.json")
    assert loaded == Settings() and problems == []


def test_bad_values_are_reported_in_one_line_and_replaced():
    path = paths.settings_file()
    path.write_text(json.dumps({"budget_mode": "turbo", "temperature": -1, "device": "tpu", "colour": "red"}))
    loaded, problems = load_settings(path)
    assert loaded.budget_mode == "auto" and loaded.temperature == Settings().temperature
    assert loaded.device == "auto"
    assert any("budget_mode='turbo'" in p for p in problems)
    assert any("unknown setting 'colour'" in p for p in problems)
    assert all("\n" not in p for p in problems)


def test_unreadable_file_is_kept_aside_not_lost():
    path = paths.settings_file()
    path.write_text("{ this is not json")
    loaded, problems = load_settings(path)
    assert loaded == Settings() and "unreadable settings" in problems[0]
    save_settings(loaded, path)
    assert path.with_name("settings.json.bad").read_text() == "{ this is not json"
    assert load_settings(path) == (Settings(), [])


def test_secrets_go_to_the_keyring_and_never_to_the_settings_file(memory_keyring, qtbot):
    from app.controller import AppController, LaunchOptions
    from app.ui.settings_dialog import SettingsDialog

    store = SecretStore()
    dialog = SettingsDialog(Settings(), store)
    qtbot.addWidget(dialog)
    dialog.api_key.setText("sk-slip-test-key-123")
    dialog.hf_token.setText("hf_secret_token_456")
    dialog.temperature.setValue(0.3)
    assert dialog.save_secrets() is None
    ctl = AppController(LaunchOptions(start_monitor=False))
    qtbot.addWidget(ctl.window)
    ctl.apply_settings(dialog.result_settings())
    text = paths.settings_file().read_text()
    assert "sk-slip-test-key-123" not in text and "hf_secret_token_456" not in text
    assert json.loads(text)["temperature"] == 0.3
    assert memory_keyring.store[("Slipstream", API_KEY)] == "sk-slip-test-key-123"
    assert store.get(HF_TOKEN) == "hf_secret_token_456"
    reopened = SettingsDialog(load_settings(paths.settings_file())[0], store)
    qtbot.addWidget(reopened)
    assert reopened.api_key.text() == "sk-slip-test-key-123" and reopened.temperature.value() == 0.3
    ctl.store.close()


def test_secret_store_set_get_delete_and_api_key(memory_keyring):
    store = SecretStore()
    assert store.get(HF_TOKEN) is None
    store.set(HF_TOKEN, "hf_abc")
    assert store.get(HF_TOKEN) == "hf_abc"
    store.set(HF_TOKEN, "")            # empty = delete
    assert store.get(HF_TOKEN) is None
    store.delete(HF_TOKEN)             # deleting nothing is fine
    key = store.ensure_api_key()
    assert key.startswith("sk-slip-") and len(key) > 30
    assert store.ensure_api_key() == key
    with pytest.raises(ValueError, match="unknown secret"):
        store.get("password")


def test_no_keyring_is_a_one_line_error():
    import keyring

    from tests.app.memory_keyring import BrokenKeyring

    previous = keyring.get_keyring()
    keyring.set_keyring(BrokenKeyring())
    try:
        with pytest.raises(SecretStoreError, match="OS keyring unavailable, huggingface-token was not saved"):
            SecretStore().set(HF_TOKEN, "hf_abc")
    finally:
        keyring.set_keyring(previous)
