"""The app's look: Fusion with a dark palette, and the colours charts and widgets share."""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

BACKGROUND = "#16181d"
PANEL = "#1e2128"
BASE = "#23262e"
TEXT = "#d7dae0"
MUTED = "#8b919c"
ACCENT = "#3fb6ff"          # Slipstream
GAME = "#ff6b4a"            # games
OTHER = "#8a8f99"           # other processes
BUDGET = "#f5d547"          # the budget line
GOOD = "#5ad17a"
WARN = "#f0a23b"
PLAN_COLORS = {"gpu_only": "#3fb6ff", "static": "#5ad17a", "dynamic": "#c58cff", "manual": "#f0a23b",
               "cpu": "#8a8f99"}


def apply_theme(app: QApplication) -> None:
    app.setStyle("Fusion")
    pal = QPalette()
    pal.setColor(QPalette.ColorRole.Window, QColor(BACKGROUND))
    pal.setColor(QPalette.ColorRole.WindowText, QColor(TEXT))
    pal.setColor(QPalette.ColorRole.Base, QColor(BASE))
    pal.setColor(QPalette.ColorRole.AlternateBase, QColor(PANEL))
    pal.setColor(QPalette.ColorRole.Text, QColor(TEXT))
    pal.setColor(QPalette.ColorRole.Button, QColor(PANEL))
    pal.setColor(QPalette.ColorRole.ButtonText, QColor(TEXT))
    pal.setColor(QPalette.ColorRole.ToolTipBase, QColor(PANEL))
    pal.setColor(QPalette.ColorRole.ToolTipText, QColor(TEXT))
    pal.setColor(QPalette.ColorRole.Highlight, QColor(ACCENT))
    pal.setColor(QPalette.ColorRole.HighlightedText, QColor("#0b0c0f"))
    pal.setColor(QPalette.ColorRole.Link, QColor(ACCENT))
    pal.setColor(QPalette.ColorRole.PlaceholderText, QColor(MUTED))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, role, QColor(MUTED))
    app.setPalette(pal)
