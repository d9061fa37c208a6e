"""Chat persistence in SQLite: conversations, messages, search, export, crash recovery.

Modules by job: :mod:`~clover_desk.storage.store` (:class:`ChatStore`, the one entry), :mod:`.database` (open, lock,
migrate, recover, transactions), :mod:`.schema` (the migrations), :mod:`.tree` (answer versions: the chosen path),
:mod:`.search`, :mod:`.export`, :mod:`.recorder` (:class:`StreamRecorder`), :mod:`.records` (the row types),
:mod:`.errors`, :mod:`.lock`, :mod:`.files` (atomic writes).

Durability model
    The database runs in WAL mode with ``synchronous=NORMAL``: every committed transaction survives a crash or a
    ``kill -9`` of the application (only a power cut can lose the last few). :meth:`ChatStore.append_streaming` is
    one committed transaction per call, and the chat view calls it each time the engine commits a block, so a crash
    loses at most the block in flight. A message still marked ``streaming`` when the database is next opened was
    interrupted: :class:`ChatStore` marks it ``stopped`` (``stats["stop_reason"] == "interrupted"``) and keeps its
    text; the ids are in :attr:`ChatStore.recovered_message_ids`.

Threading
    A :class:`ChatStore` belongs to the thread that opened it (the GUI thread). sqlite3's ``check_same_thread``
    guard turns a call from any other thread into ``sqlite3.ProgrammingError`` instead of silent corruption. The
    calls are small single-row statements (well under a millisecond), which is why they may run on the GUI thread.
    One application instance opens a given database at a time, and this is enforced: :class:`ChatStore` takes an
    exclusive OS lock (:class:`StoreLock`: ``fcntl.flock`` on Linux/macOS, ``msvcrt.locking`` on Windows) on
    ``<database>.lock`` beside the database *before* anything else, crash recovery included, and holds it until
    :meth:`ChatStore.close`. A second instance is refused with :class:`StoreLockedError` (the GUI says "Clover Desk
    is already running with this data folder" and exits with status 2); it never opens the database read-only, so
    it can never mark the first instance's streaming answer "stopped". The OS drops the lock when its process ends,
    however it ends, so a crash or ``kill -9`` never leaves a stale lock.

Write failures
    Every change runs in one transaction (:meth:`Database.transaction`). When the disk is full (``database or disk is
    full``, ``ENOSPC``), the folder is read-only or the disk reports an I/O error, the transaction is rolled back
    (nothing of that change is kept, the database stays usable) and :class:`StorageWriteError` is raised with one
    line that names the file and what to do; :class:`StreamRecorder` stops saving the answer on the first failure.
    A data folder where the lock file cannot be created (read-only) is refused at open with a
    :class:`StorageWriteError` that says to make it writable or to set ``CLOVER_DESK_HOME``.

Schema
    Versioned by the ``schema_migrations`` table (one row per applied migration; ``PRAGMA user_version`` mirrors the
    latest). :data:`MIGRATIONS` is append-only; each migration runs in its own transaction together with its row.
    Since schema 4 a chat's messages form a tree: each hangs under the one it follows (``parent_id``), a
    regenerated answer or an edited message is a sibling (a *version*), one version per place is chosen
    (``selected``), and :meth:`ChatStore.messages` (what is shown, sent to the engine, exported) is the chosen path.
    A database written by a newer Clover Desk (unknown version) is refused with :class:`StorageError`.
"""
