"""`SettingsDialog`: device, backend, sampling, system prompt, model folders, the budget reserve, the local
OpenAI-compatible API (on/off, port, its address as the worker reports it, live), and the secrets (local
API key, Hugging Face token), which go to the OS keyring, never to the settings file. The API key is
shown masked, with Show, Copy and New key buttons."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import theme
from app.secret_store import API_KEY, HF_TOKEN, SecretStore, SecretStoreError
from app.settings import BACKENDS, DEVICES, Settings


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, secrets: SecretStore, parent: QWidget | None = None,
                 api_status: dict | None = None):
        super().__init__(parent)
        self.setWindowTitle("Slipstream settings")
        self.secrets = secrets
        self._settings = settings
        self.device = QComboBox()
        self.device.addItems(list(DEVICES))
        self.device.setEditable(True)
        self.device.setCurrentText(settings.device)
        self.backend = QComboBox()
        self.backend.addItems(list(BACKENDS))
        self.backend.setCurrentText(settings.backend)
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 1 << 20)
        self.max_new_tokens.setValue(settings.max_new_tokens)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(settings.temperature)
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setValue(settings.top_p)
        self.reserve_gib = QDoubleSpinBox()
        self.reserve_gib.setRange(0.0, 64.0)
        self.reserve_gib.setSingleStep(0.25)
        self.reserve_gib.setSuffix(" GiB")
        self.reserve_gib.setValue(settings.reserve / (1 << 30))
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setMaximumHeight(80)
        self.model_dirs = QLineEdit("; ".join(settings.extra_model_dirs))
        self.model_dirs.setPlaceholderText("more folders with models, separated by ;")
        self.api_port = QSpinBox()
        self.api_port.setRange(1, 65535)
        self.api_port.setValue(settings.api_port)
        self.api_enabled = QCheckBox("Serve the OpenAI-compatible API on this computer (127.0.0.1 only)")
        self.api_enabled.setChecked(settings.api_enabled)
        self.api_address = QLabel()
        self.api_address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_address = QPushButton("Copy")
        self.copy_address.setToolTip("Copy the API's base URL")
        self.copy_address.clicked.connect(lambda: self._copy(self._address or ""))
        self._address: str | None = None
        self.api_key = QLineEdit()
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_key = QPushButton("Show")
        self.show_key.setCheckable(True)
        self.show_key.toggled.connect(self._toggle_key)
        self.copy_key = QPushButton("Copy")
        self.copy_key.setToolTip("Copy the API key")
        self.copy_key.clicked.connect(lambda: self._copy(self.api_key.text()))
        self.hf_token = QLineEdit()
        self.hf_token.setEchoMode(QLineEdit.EchoMode.Password)
        self.keyring_status = QLabel()
        self.keyring_status.setStyleSheet(f"color: {theme.MUTED};")
        self.keyring_status.setWordWrap(True)
        try:
            self.api_key.setText(secrets.get(API_KEY) or "")
            self.hf_token.setText(secrets.get(HF_TOKEN) or "")
            self.keyring_status.setText(f"Secrets are kept in the OS keyring ({secrets.backend_name()}).")
        except SecretStoreError as exc:
            self.keyring_status.setText(str(exc))
        generate = QPushButton("New key")
        generate.clicked.connect(self._new_key)
        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        key_row.addWidget(self.show_key)
        key_row.addWidget(self.copy_key)
        key_row.addWidget(generate)
        address_row = QHBoxLayout()
        address_row.addWidget(self.api_address, 1)
        address_row.addWidget(self.copy_address)
        self.show_api_status(api_status or {"running": False, "address": None})
        form = QFormLayout()
        form.addRow("Device", self.device)
        form.addRow("Backend", self.backend)
        form.addRow("Max new tokens", self.max_new_tokens)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("System prompt", self.system_prompt)
        form.addRow("VRAM left for others (auto)", self.reserve_gib)
        form.addRow("Model folders", self.model_dirs)
        form.addRow("Local API", self.api_enabled)
        form.addRow("Local API port", self.api_port)
        form.addRow("Local API address", address_row)
        form.addRow("Local API key", key_row)
        form.addRow("Hugging Face token", self.hf_token)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.error = QLabel()
        self.error.setStyleSheet(f"color: {theme.GAME};")
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.keyring_status)
        layout.addWidget(self.error)
        layout.addWidget(buttons)

    def show_api_status(self, status: dict) -> None:
        """Show what the engine worker reports about the API server (its `api` event)."""
        running = bool(status.get("running")) and bool(status.get("address"))
        self._address = status.get("address") if running else None
        if running:
            self.api_address.setText(str(self._address))
        elif status.get("error"):
            self.api_address.setText(f"not running: {status['error']}")
        else:
            self.api_address.setText("off")
        self.copy_address.setEnabled(running)

    def _toggle_key(self, shown: bool) -> None:
        self.api_key.setEchoMode(QLineEdit.EchoMode.Normal if shown else QLineEdit.EchoMode.Password)
        self.show_key.setText("Hide" if shown else "Show")

    @staticmethod
    def _copy(text: str) -> None:
        if text:
            QGuiApplication.clipboard().setText(text)

    def _new_key(self) -> None:
        import secrets as random

        self.api_key.setText("sk-slip-" + random.token_urlsafe(32))

    def result_settings(self) -> Settings:
        """The edited settings (secrets excluded)."""
        dirs = [d.strip() for d in self.model_dirs.text().split(";") if d.strip()]
        return replace(self._settings, device=self.device.currentText().strip() or "auto",
                       backend=self.backend.currentText(), max_new_tokens=self.max_new_tokens.value(),
                       temperature=round(self.temperature.value(), 3), top_p=round(self.top_p.value(), 3),
                       system_prompt=self.system_prompt.toPlainText(), extra_model_dirs=dirs,
                       reserve=int(self.reserve_gib.value() * (1 << 30)), api_port=self.api_port.value(),
                       api_enabled=self.api_enabled.isChecked())

    def save_secrets(self) -> str | None:
        """Store the secrets in the keyring; returns a one-line problem, or None."""
        try:
            self.secrets.set(API_KEY, self.api_key.text().strip())
            self.secrets.set(HF_TOKEN, self.hf_token.text().strip())
        except SecretStoreError as exc:
            return str(exc)
        return None
