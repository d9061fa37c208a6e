-- A Clover Desk chat database at schema 3 (commit 41d9ac3), written by make_schema3_fixture.py
BEGIN TRANSACTION;
CREATE TABLE conversations (
                id INTEGER PRIMARY KEY,
                title TEXT NOT NULL,
                created REAL NOT NULL,
                updated REAL NOT NULL,
                system_prompt TEXT NOT NULL DEFAULT '',
                settings TEXT NOT NULL DEFAULT '{}'
            );
INSERT INTO "conversations" VALUES(1,'Trip plan',1.79629095395761108396e+09,1.79629095395919966696e+09,'Be brief.','{"temperature": 0.6}');
INSERT INTO "conversations" VALUES(2,'Edited question',1.7962909539593880176e+09,1.79629095396042299265e+09,'','{}');
INSERT INTO "conversations" VALUES(3,'Crashed answer',1.79629095396059322358e+09,1.79629095396084022522e+09,'','{}');
INSERT INTO "conversations" VALUES(4,'Empty chat',1.79629095396100497243e+09,1.79629095396100497243e+09,'','{}');
CREATE TABLE "messages" (
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
            );
INSERT INTO "messages" VALUES(1,1,'user','Plan two days in Lisbon','',NULL,'complete','{}',1.79629095395793938636e+09);
INSERT INTO "messages" VALUES(2,1,'assistant','Day 1: Alfama.

```python
print(''tram 28'')
```','hmm',1.5,'complete','{"tokens": 61, "stop_reason": "eos", "mode": "diffusion"}',1.79629095395841455453e+09);
INSERT INTO "messages" VALUES(3,1,'user','And a third day?','',NULL,'complete','{}',1796290953.95864);
INSERT INTO "messages" VALUES(5,1,'assistant','Day 3: Belém and Sintra.','',NULL,'complete','{"tokens": 6, "stop_reason": "eos"}',1.79629095395919966696e+09);
INSERT INTO "messages" VALUES(6,2,'user','What is 3+3?','',NULL,'complete','{}',1.79629095395950055119e+09);
INSERT INTO "messages" VALUES(8,2,'assistant','6','',NULL,'complete','{}',1.79629095396042299265e+09);
INSERT INTO "messages" VALUES(9,3,'user','Write a long story','',NULL,'complete','{}',1.79629095396069097517e+09);
INSERT INTO "messages" VALUES(10,3,'assistant','Once upon a ti','',NULL,'streaming','{}',1.79629095396084022522e+09);
CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied REAL NOT NULL);
INSERT INTO "schema_migrations" VALUES(1,'conversations and messages',1.7962909539550402164e+09);
INSERT INTO "schema_migrations" VALUES(2,'indexes for the chat list and message order',1.79629095395552945135e+09);
INSERT INTO "schema_migrations" VALUES(3,'message ids are never reused (AUTOINCREMENT)',1.79629095395733594893e+09);
CREATE INDEX conversations_by_updated ON conversations(updated DESC, id DESC);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
CREATE INDEX messages_streaming ON messages(status) WHERE status = 'streaming';
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('messages',10);
COMMIT;
