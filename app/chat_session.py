"""`ChatSession`: the open conversation and its generations. It writes every streamed piece to the
store as it arrives (so a crash loses nothing), mirrors it into the view, and ends answers as complete,
stopped, interrupted (the worker died) or failed."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.conversations import ConversationStore, title_from
from app.settings import Settings
from app.ui.message_view import MessageList
from app.worker_client import WorkerClient

_STATUS = {"cancelled": "cancelled", "interrupted": "interrupted", "error": "error"}


class ChatSession(QObject):
    generatingChanged = Signal(bool)
    conversationsChanged = Signal()
    finished = Signal(str, dict)            # finish_reason, stats

    def __init__(self, store: ConversationStore, worker: WorkerClient, view: MessageList, settings: Settings,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.store = store
        self.worker = worker
        self.view = view
        self.settings = settings
        self.conversation_id: int | None = None
        self.active: dict[str, tuple[int, int]] = {}      # request id -> (conversation id, message id)
        worker.token.connect(self._token)
        worker.done.connect(self._done)

    @property
    def generating(self) -> bool:
        return bool(self.active)

    def open(self, conversation_id: int) -> None:
        if self.store.get(conversation_id) is None:
            return
        self.conversation_id = conversation_id
        self.view.set_messages(self.store.messages(conversation_id))

    def new(self) -> int:
        cid = self.store.create()
        self.conversation_id = cid
        self.view.set_messages([])
        self.conversationsChanged.emit()
        return cid

    def delete(self, conversation_id: int) -> None:
        for rid, (cid, _mid) in list(self.active.items()):
            if cid == conversation_id:
                self.worker.cancel(rid)
        self.store.delete(conversation_id)
        if conversation_id == self.conversation_id:
            remaining = self.store.list()
            if remaining:
                self.open(remaining[0].id)
            else:
                self.conversation_id = None
                self.view.set_messages([])
        self.conversationsChanged.emit()

    def send(self, text: str, images: list[str] | None = None) -> str | None:
        """Add the user's message and start the answer; returns the request id."""
        if self.generating:
            return None
        if self.conversation_id is None or self.store.get(self.conversation_id) is None:
            self.new()
        cid = self.conversation_id
        first = not self.store.messages(cid)
        user_id = self.store.add_message(cid, "user", text, images=images or [])
        if first:
            self.store.rename(cid, title_from(text or "Image"))
        history = self._history(cid)
        answer_id = self.store.add_message(cid, "assistant", "", status="streaming")
        self.view.add_message(self.store.message(user_id))
        self.view.add_message(self.store.message(answer_id))
        params = {"max_new_tokens": self.settings.max_new_tokens, "temperature": self.settings.temperature,
                  "top_p": self.settings.top_p}
        rid = self.worker.generate(history, params, images or [])
        self.active[rid] = (cid, answer_id)
        self.generatingChanged.emit(True)
        self.conversationsChanged.emit()
        return rid

    def stop(self) -> None:
        for rid in list(self.active):
            self.worker.cancel(rid)

    def _history(self, cid: int) -> list[dict]:
        messages: list[dict] = []
        if self.settings.system_prompt.strip():
            messages.append({"role": "system", "content": self.settings.system_prompt.strip()})
        for m in self.store.messages(cid):
            if m.role == "assistant" and not m.content.strip():
                continue
            messages.append({"role": m.role, "content": m.content})
        return messages

    def _token(self, rid: str, text: str) -> None:
        target = self.active.get(rid)
        if target is None or not text:
            return
        cid, mid = target
        self.store.append(mid, text)
        if cid == self.conversation_id:
            self.view.append_text(mid, text)

    def _done(self, rid: str, reason: str, stats: dict) -> None:
        target = self.active.pop(rid, None)
        if target is None:
            return
        cid, mid = target
        status = _STATUS.get(reason, "complete")
        self.store.finish(mid, status, reason)
        if cid == self.conversation_id:
            self.view.set_status(mid, status)
        self.finished.emit(reason, stats)
        if not self.active:
            self.generatingChanged.emit(False)
