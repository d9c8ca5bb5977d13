"""Conversations in SQLite (WAL), written as answers stream so a crash of the app or the worker loses
nothing. Each appended piece of an answer is committed at once.

Tables: `conversations(id, title, created, updated)` and `messages(id, conversation_id, role, content,
images, status, finish_reason, created)`. A message's status is "complete", "streaming", "cancelled",
"interrupted" (the worker or the app died mid-answer) or "error". On open, answers left "streaming" by
a crashed session become "interrupted".
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL DEFAULT '',
    images TEXT NOT NULL DEFAULT '[]',
    status TEXT NOT NULL DEFAULT 'complete',
    finish_reason TEXT,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


class StoreError(Exception):
    """The conversation database could not be opened or written; one line naming the file."""


@dataclass(slots=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    images: list[str] = field(default_factory=list)
    status: str = "complete"
    finish_reason: str | None = None


@dataclass(slots=True)
class Conversation:
    id: int
    title: str
    updated: float


class ConversationStore:
    """All reads and writes of conversations; used from the UI thread only."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{path}: written by a newer Slipstream (schema {version}); not touched")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            self._db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{path}: not a readable conversation database ({exc})") from exc

    def close(self) -> None:
        self._db.close()

    # ---- conversations ---------------------------------------------------------------------------
    def create(self, title: str = "New chat") -> int:
        now = time.time()
        cur = self._db.execute("INSERT INTO conversations(title, created, updated) VALUES (?, ?, ?)",
                               (title, now, now))
        return int(cur.lastrowid)

    def list(self) -> list[Conversation]:
        rows = self._db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC, id DESC")
        return [Conversation(*r) for r in rows]

    def get(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT id, title, updated FROM conversations WHERE id=?",
                               (conversation_id,)).fetchone()
        return Conversation(*row) if row else None

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split()) or "Untitled"
        self._db.execute("UPDATE conversations SET title=? WHERE id=?", (title[:200], conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,))

    # ---- messages --------------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str = "", *, images: list[str] | None = None,
                    status: str = "complete") -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages(conversation_id, role, content, images, status, created) VALUES (?,?,?,?,?,?)",
            (conversation_id, role, content, json.dumps(images or []), status, now))
        self._db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, conversation_id))
        return int(cur.lastrowid)

    def append(self, message_id: int, piece: str) -> None:
        """Append streamed text to a message; committed before returning."""
        if piece:
            self._db.execute("UPDATE messages SET content = content || ? WHERE id=?", (piece, message_id))

    def finish(self, message_id: int, status: str, finish_reason: str | None = None) -> None:
        self._db.execute("UPDATE messages SET status=?, finish_reason=? WHERE id=?",
                         (status, finish_reason, message_id))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, conversation_id, role, content, images, status, finish_reason FROM messages "
            "WHERE conversation_id=? ORDER BY id", (conversation_id,))
        return [Message(r[0], r[1], r[2], r[3], json.loads(r[4] or "[]"), r[5], r[6]) for r in rows]

    def message(self, message_id: int) -> Message | None:
        r = self._db.execute("SELECT id, conversation_id, role, content, images, status, finish_reason "
                             "FROM messages WHERE id=?", (message_id,)).fetchone()
        return Message(r[0], r[1], r[2], r[3], json.loads(r[4] or "[]"), r[5], r[6]) if r else None


def title_from(text: str, limit: int = 48) -> str:
    """A conversation title from the first user message."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
