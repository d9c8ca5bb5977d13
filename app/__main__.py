"""`python -m app` / `slipstream`: start the tray app (`--show-chat` opens the chat window at start)."""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slipstream", description="Slipstream: local LLMs in the VRAM a game "
                                     "leaves free")
    parser.add_argument("--show-chat", action="store_true", help="open the chat window at start")
    parser.add_argument("--model", metavar="PATH", help="a GGUF file or Hugging Face folder for this run "
                        "(default: the last one chosen, else the bundled SmolLM2-135M)")
    parser.add_argument("--device", help="auto | cuda | cuda:N | cpu | sim (default: from settings)")
    parser.add_argument("--backend", choices=("auto", "torch", "llamacpp"), help="engine backend")
    parser.add_argument("--no-monitor", action="store_true", help="do not start the VRAM monitor")
    return parser.parse_args(argv)


def _quit_on_signals(quit_app) -> None:
    """Ctrl+C and SIGTERM quit cleanly (worker shut down, database closed)."""
    import signal

    from PySide6.QtCore import QTimer

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: QTimer.singleShot(0, quit_app))
    timer = QTimer()
    timer.timeout.connect(lambda: None)   # let Python run its signal handlers while Qt waits
    timer.start(250)
    return timer


def _tear_down(app, *objects) -> None:
    """Delete the app's Qt objects while the QApplication still exists, not during interpreter exit
    (PySide6 6.12.0 aborts in a refcount bug when it collects them at exit)."""
    import gc
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for obj in objects:
        obj.deleteLater()
    app.sendPostedEvents(None, 0)
    gc.collect()


def run_app(argv: list[str] | None = None) -> int:
    """Run the app until it quits; returns the exit status (everything saved and closed by then)."""
    import gc

    args = parse_args(argv)
    from app.platform_check import platform_problem

    problem = platform_problem()
    if problem is not None:          # (Qt would abort the process without naming what is missing)
        print(problem, file=sys.stderr)
        return 2
    from PySide6.QtWidgets import QApplication

    from app import APP_NAME
    from app.controller import AppController, LaunchOptions
    from app.icons import app_icon
    from app.single_instance import SingleInstance
    from app.theme import apply_theme

    app = QApplication(sys.argv[:1])
    app.setApplicationName(APP_NAME)
    app.setApplicationDisplayName(APP_NAME)
    app.setQuitOnLastWindowClosed(False)
    app.setWindowIcon(app_icon())
    instance = SingleInstance()
    if instance.notify_running("show-chat"):
        print("Slipstream is already running: showing its chat window.", file=sys.stderr)
        return 0
    instance.listen()
    apply_theme(app)
    model = args.model
    if model is not None:
        from pathlib import Path

        model = str(Path(model).expanduser().resolve())
    controller = AppController(LaunchOptions(show_chat=args.show_chat, model=model, device=args.device,
                                             backend=args.backend, start_monitor=not args.no_monitor))
    instance.messageReceived.connect(controller.show_chat)   # "show-chat" from a second launch
    timer = _quit_on_signals(controller.quit)
    controller.start()
    code = app.exec()
    controller.quit()
    instance.close()
    timer.stop()
    _tear_down(app, timer, controller.window, controller, instance)
    del controller, instance, timer
    gc.collect()
    return code


def main(argv: list[str] | None = None) -> int:
    """Process entry (`python -m app`, the `slipstream` command). Everything is saved and closed when
    `run_app` returns, so the process ends there, without the interpreter's final garbage collection,
    which PySide6 6.12.0 can abort in (a refcount bug at exit)."""
    code = run_app(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
