"""The chat database's schema: the append-only migrations."""

from __future__ import annotations

# Append-only: (version, description, statements). Never edit a released migration; add a new one.
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "conversations and messages",
        (
            """CREATE TABLE conversations (
                id INTEGER PRIMARY KEY,
                title TEXT NOT NULL,
                created REAL NOT NULL,
                updated REAL NOT NULL,
                system_prompt TEXT NOT NULL DEFAULT '',
                settings TEXT NOT NULL DEFAULT '{}'
            )""",
            """CREATE TABLE messages (
                id INTEGER PRIMARY KEY,
                conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
                content TEXT NOT NULL DEFAULT '',
                thinking TEXT NOT NULL DEFAULT '',
                thinking_seconds REAL,
                status TEXT NOT NULL DEFAULT 'complete'
                    CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
                stats TEXT NOT NULL DEFAULT '{}',
                created REAL NOT NULL
            )""",
        ),
    ),
    (
        2,
        "indexes for the chat list and message order",
        (
            "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
            "CREATE INDEX conversations_by_updated ON conversations(updated DESC, id DESC)",
            "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
        ),
    ),
    (
        3,
        "message ids are never reused (AUTOINCREMENT)",
        # A message id names things outside the database (the preview's document, whose origin holds the page's
        # storage): a plain rowid is handed out again after the newest row is deleted. SQLite cannot add
        # AUTOINCREMENT to a table, so the table is rebuilt with the same rows and ids; the sequence then starts
        # after the largest id kept (ids deleted in an earlier run cannot be known, and nothing outside the
        # database outlives a run).
        (
            """CREATE TABLE messages_v3 (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
                content TEXT NOT NULL DEFAULT '',
                thinking TEXT NOT NULL DEFAULT '',
                thinking_seconds REAL,
                status TEXT NOT NULL DEFAULT 'complete'
                    CHECK (status IN ('complete', 'streaming', 'stopped', 'error')),
                stats TEXT NOT NULL DEFAULT '{}',
                created REAL NOT NULL
            )""",
            "INSERT INTO messages_v3 (id, conversation_id, role, content, thinking, thinking_seconds, status, stats,"
            " created) SELECT id, conversation_id, role, content, thinking, thinking_seconds, status, stats, created"
            " FROM messages ORDER BY id",
            "DROP TABLE messages",
            "ALTER TABLE messages_v3 RENAME TO messages",
            "CREATE INDEX messages_by_conversation ON messages(conversation_id, id)",
            "CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming'",
        ),
    ),
    (
        4,
        "answer versions: messages form a tree (parent_id), one chosen child per message (selected)",
        # A chat was a list; now every message hangs under the one before it (parent_id; NULL: the chat's first),
        # and a regenerated answer or an edited message is a sibling: a new version beside the old. Among siblings
        # the one with selected = 1 is on show, and the chat is the path of chosen messages from the first. A chat
        # written before is one path: each message's parent is the message before it, every one chosen.
        (
            "ALTER TABLE messages ADD COLUMN parent_id INTEGER",
            "ALTER TABLE messages ADD COLUMN selected INTEGER NOT NULL DEFAULT 1",
            "UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p "
            "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)",
            "CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id, selected)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1][0]
