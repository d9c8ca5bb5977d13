"""Write the app icon as PNG files (for installers and desktop entries) from `app.icons.draw_icon`.

    QT_QPA_PLATFORM=offscreen python assets/make_icons.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from PySide6.QtGui import QGuiApplication  # noqa: E402

from app.icons import STATE_COLORS, draw_icon  # noqa: E402

SIZES = (16, 32, 48, 64, 128, 256, 512)


def main() -> int:
    app = QGuiApplication(sys.argv[:1])  # noqa: F841 - QPixmap needs the application object
    for size in SIZES:
        draw_icon(size).save(str(HERE / f"slipstream-{size}.png"))
    for state in STATE_COLORS:
        draw_icon(64, state).save(str(HERE / f"tray-{state}.png"))
    print(f"wrote {len(SIZES) + len(STATE_COLORS)} icons to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
