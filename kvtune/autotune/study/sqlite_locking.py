"""Write-locking transactions for SQLite study storage.

Optuna claims a queued trial (a warm start, a retry, a resampled duplicate) by reading its state
with SELECT ... FOR UPDATE and setting it RUNNING in one transaction. SQLite ignores FOR UPDATE
and pysqlite begins transactions lazily, so two workers can both read WAITING and both run the
trial: one policy measured twice, and one worker crashing when it reports a finished trial.
Beginning every transaction with BEGIN IMMEDIATE takes SQLite's write lock up front, which makes
the read and the update one atomic step. PostgreSQL honours FOR UPDATE and needs nothing.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy
from optuna.storages import RDBStorage

# Seconds a transaction waits for another worker's lock before SQLite reports "locked".
BUSY_TIMEOUT_S = 60.0


def lock_sqlite_transactions(storage: RDBStorage) -> None:
    """Make each transaction of a SQLite storage take the database's write lock when it begins.
    An in-memory database lives in one connection of one process (no second worker can join),
    and closing that connection would drop it: it is left as it is."""
    engine = storage.engine
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" event emits BEGIN itself
        dbapi_connection.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")

    def on_begin(connection: sqlalchemy.engine.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    sqlalchemy.event.listen(engine, "connect", on_connect)
    sqlalchemy.event.listen(engine, "begin", on_begin)
    engine.dispose()  # connections opened while Optuna created its tables predate the hooks
