"""The app icon, drawn with QPainter (no image files needed): a rounded tile with three streamlines.
The tray variant's colour shows the engine's state. `assets/make_icons.py` writes it out as PNG files."""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

STATE_COLORS = {"idle": "#3fb6ff", "busy": "#5ad17a", "paused": "#f5d547", "error": "#ff6b4a",
                "loading": "#8a8f99"}


def draw_icon(size: int, state: str = "idle") -> QPixmap:
    pix = QPixmap(size, size)
    pix.fill(Qt.GlobalColor.transparent)
    p = QPainter(pix)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QColor("#16181d"))
    p.drawRoundedRect(QRectF(s * 0.04, s * 0.04, s * 0.92, s * 0.92), s * 0.22, s * 0.22)
    color = QColor(STATE_COLORS.get(state, STATE_COLORS["idle"]))
    for i, (y, width) in enumerate(((0.32, 0.09), (0.5, 0.11), (0.68, 0.09))):
        pen = QPen(color if i != 1 else color.lighter(120), s * width, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap)
        p.setPen(pen)
        path = QPainterPath(QPointF(s * (0.2 + 0.06 * i), s * y))
        path.cubicTo(QPointF(s * 0.42, s * (y - 0.12)), QPointF(s * 0.58, s * (y + 0.12)),
                     QPointF(s * (0.8 - 0.06 * (2 - i)), s * y))
        p.drawPath(path)
    p.end()
    return pix


def app_icon(state: str = "idle") -> QIcon:
    icon = QIcon()
    for size in (16, 22, 24, 32, 48, 64, 128, 256):
        icon.addPixmap(draw_icon(size, state))
    return icon
