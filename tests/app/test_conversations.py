"""The conversation store: create, rename, delete, streamed appends that survive a crash."""

from __future__ import annotations

import sqlite3

import pytest

from app import paths
from app.conversations import ConversationStore, StoreError, title_from


def test_conversations_crud():
    store = ConversationStore(paths.conversations_db())
    a = store.create()
    b = store.create("Second")
    store.rename(a, "  Renamed \n chat ")
    assert {c.title for c in store.list()} == {"Renamed chat", "Second"}
    store.add_message(b, "user", "hi")
    store.delete(b)
    assert [c.id for c in store.list()] == [a]
    assert store.messages(b) == []


def test_streamed_text_is_on_disk_before_the_answer_ends():
    db = paths.conversations_db()
    store = ConversationStore(db)
    cid = store.create()
    store.add_message(cid, "user", "hello", images=["/tmp/cat.png"])
    mid = store.add_message(cid, "assistant", "", status="streaming")
    for piece in ("Hel", "lo", " wor", "ld"):
        store.append(mid, piece)
    # Another connection (a crashed app's successor) sees every piece already.
    other = sqlite3.connect(str(db))
    assert other.execute("SELECT content FROM messages WHERE id=?", (mid,)).fetchone()[0] == "Hello world"
    other.close()
    # "Crash": never finish; the next start marks the answer interrupted and keeps its text.
    reopened = ConversationStore(db)
    msgs = reopened.messages(cid)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].images == ["/tmp/cat.png"]
    assert msgs[1].content == "Hello world" and msgs[1].status == "interrupted"


def test_not_a_database_is_a_one_line_error_and_the_file_is_untouched():
    db = paths.conversations_db()
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a readable conversation database"):
        ConversationStore(db)
    assert db.read_bytes() == b"this is not sqlite" * 100


def test_title_from_first_message():
    assert title_from("  What is\nthe capital of France? ") == "What is the capital of France?"
    assert title_from("x" * 100).endswith("…") and len(title_from("x" * 100)) == 48
