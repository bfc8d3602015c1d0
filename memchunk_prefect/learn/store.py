"""Observations on disk: one SQLite file of plain rows, shared by flows, processes and hosts.

What it covers: where the store lives, its schema (versioned, migrated
forward), concurrent writers, recovery from a corrupt or foreign file, export.
What it does not: learning (``bank.py`` replays these rows; nothing here is
ever pickled or unpickled).

Where: ``$MEMCHUNK_STORE`` if set, else ``<PREFECT_HOME>/memchunk/observations.sqlite``
(:func:`default_store_path`). The runner's ``store=`` and the CLI's ``--store``
override both.

Concurrency. Every write is one short ``BEGIN IMMEDIATE`` transaction and the
connection waits up to ``busy_timeout_ms`` for a lock, so two flows writing at
once both land. On a local filesystem the journal is WAL (readers never block
the writer). WAL needs shared memory between the processes, i.e. one host: on a
network filesystem (NFS, CIFS/SMB, Lustre, GPFS, BeeGFS, CephFS, GlusterFS,
sshfs — detected from ``/proc/mounts``) the store uses ``journal_mode=DELETE``
with the same busy timeout, which relies on the filesystem's POSIX locks (NFSv4
and Lustre/GPFS with locking enabled provide them). Force either with
``Store(path, journal_mode="wal"|"delete")`` or ``$MEMCHUNK_STORE_JOURNAL``.

Schema. ``PRAGMA user_version`` holds the schema version and a ``meta`` table
names the application. An older store is migrated in place, in one
transaction (:data:`MIGRATIONS`). A store written by a newer version raises
:class:`~memchunk_prefect.core.errors.StoreSchemaTooNewError` and is left untouched.
A file that is not SQLite, or a SQLite database that is not ours, is renamed
``<name>.corrupt-<YYYYmmdd-HHMMSS>`` with a :class:`StoreMovedAsideWarning`, and
a fresh store begins.

Permissions: directories created here are ``0700`` and the database file
``0600`` (SQLite gives its ``-wal``/``-shm``/``-journal`` files the same mode).

>>> import tempfile, os
>>> from memchunk_prefect.core.records import Observation
>>> with Store(os.path.join(tempfile.mkdtemp(), "obs.sqlite")) as s:
...     _ = s.add(Observation("envelope|float32|cpu", 1000, (10, 10, 10), 4000, 90000))
...     [o.peak_bytes for o in s.observations()], s.keys()
([90000], ['envelope|float32|cpu'])
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from memchunk_prefect.core.errors import StoreError, StoreSchemaTooNewError
from memchunk_prefect.core.records import MapRun, Observation, Reward

SCHEMA_VERSION = 15
"""The schema this code writes. v1: extents as one text column "IxXxT", fewer fields. v2: one column per field.
v3: what the worker held when a run started. v4: the learned policy's rewards (a ``rewards`` table). v5: what a
trace needs (energy's source, start, task run, host; ``maps`` and ``machines`` tables). v6: what other runs on the
worker held when a run started. v7: how far a run took the worker above the most it had held (``grew_bytes``).
v8: a GPU map's device budget and GPU out-of-memory. v9: a run's kernel CPU time (``sys_seconds``). v10: what a
run left held in its worker (``retained_bytes``). v11: what a simulation of a map on another cluster needs (its
parameters, whether it keeps traces whole, the cluster's shape: ``maps`` columns). v12: whether a run was its
worker process's first call of its operator (``first_call``). v13: when the runner submitted a run's task
(``submitted_at``). v14: the worker threads per CPU core a map's budget counted (``maps.threads_per_core``).
v15: when in its run a run's memory reached half and 90% of its peak (``rise_50``, ``rise_90``)."""

APPLICATION = "memchunk-prefect"
BUSY_TIMEOUT_MS = 30_000
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "panfs", "9p", "afs", "ocfs2", "gfs2",
})


class StoreMovedAsideWarning(UserWarning):
    """The store file was corrupt or foreign; it was renamed and a fresh store begun."""


# --------------------------------------------------------------------------- location


def default_store_path() -> Path:
    """``$MEMCHUNK_STORE``, else ``<PREFECT_HOME>/memchunk/observations.sqlite``.

    PREFECT_HOME comes from the environment, or from Prefect's settings when
    Prefect is already imported (importing it just for this costs a second or
    more), else Prefect's default ``~/.prefect``.
    """
    env = os.environ.get("MEMCHUNK_STORE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("PREFECT_HOME")
    if not home:
        import sys

        if "prefect.settings" in sys.modules:
            try:
                from prefect.settings import PREFECT_HOME

                home = str(PREFECT_HOME.value())
            except Exception:  # pragma: no cover - prefect API moved
                home = None
    return Path(home or "~/.prefect").expanduser() / "memchunk" / "observations.sqlite"


def filesystem_type(path: str | os.PathLike, mounts_file: str = "/proc/mounts") -> str | None:
    """The filesystem type of the mount holding ``path`` (from ``/proc/mounts``), or None if unknown."""
    try:
        with open(mounts_file, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        prefix = mount.rstrip("/") + "/"
        if (target == mount or target.startswith(prefix) or mount == "/") and len(mount) >= len(best):
            best, best_type = mount, parts[2]
    return best_type


def is_network_filesystem(path: str | os.PathLike, mounts_file: str = "/proc/mounts") -> bool:
    """Whether ``path`` lies on a filesystem shared between hosts (WAL would be unsafe there)."""
    fstype = filesystem_type(path, mounts_file)
    return fstype is not None and (fstype in NETWORK_FILESYSTEMS or fstype.split(".")[0] in NETWORK_FILESYSTEMS)


# --------------------------------------------------------------------------- schema


_COLUMNS: list[tuple[str, str]] = [
    ("operator_key", "TEXT NOT NULL"),
    ("elements", "INTEGER NOT NULL"),
    ("extent_iline", "INTEGER NOT NULL"),
    ("extent_xline", "INTEGER NOT NULL"),
    ("extent_twt", "INTEGER NOT NULL"),
    ("bytes_in", "INTEGER NOT NULL"),
    ("peak_bytes", "INTEGER NOT NULL"),
    ("seconds", "REAL NOT NULL"),
    ("outcome", "TEXT NOT NULL"),
    ("censored", "INTEGER NOT NULL"),
    ("cpu_seconds", "REAL"),
    ("worker", "TEXT NOT NULL"),
    ("chunk", "TEXT NOT NULL"),
    ("budget_bytes", "INTEGER"),
    ("gpu_peak_bytes", "INTEGER"),
    ("energy_joules", "REAL"),
    ("shared", "INTEGER NOT NULL"),
    ("method", "TEXT NOT NULL"),
    ("flow_run_id", "TEXT NOT NULL"),
    ("created_at", "REAL NOT NULL"),
    ("baseline_bytes", "INTEGER"),
    ("resting_bytes", "INTEGER"),
    ("energy_source", "TEXT"),
    ("started_at", "REAL"),
    ("task_run_id", "TEXT NOT NULL DEFAULT ''"),
    ("host", "TEXT NOT NULL DEFAULT ''"),
    ("map_id", "TEXT NOT NULL DEFAULT ''"),
    ("others_bytes", "INTEGER"),
    ("grew_bytes", "INTEGER"),
    ("gpu_budget_bytes", "INTEGER"),
    ("gpu_out_of_memory", "INTEGER NOT NULL DEFAULT 0"),
    ("sys_seconds", "REAL"),
    ("retained_bytes", "INTEGER"),
    ("first_call", "INTEGER"),
    ("submitted_at", "REAL"),
    ("rise_50", "REAL"),
    ("rise_90", "REAL"),
]
COLUMN_NAMES = [c for c, _ in _COLUMNS]

#: Columns added in schema version 3 (what the worker held when a run started, what the budget assumed).
_ADDED_V3 = ("baseline_bytes", "resting_bytes")
#: Columns added in schema version 5 (what a trace of a run needs: energy's source, start, task run, host).
_ADDED_V5 = ("energy_source", "started_at", "task_run_id", "host", "map_id")
#: Columns added in schema version 6 (what other runs on the worker held when a run started).
_ADDED_V6 = ("others_bytes",)
#: Columns added in schema version 7 (how far a run took the worker above the most it had held before).
_ADDED_V7 = ("grew_bytes",)
#: Columns added in schema version 8 (a GPU map's budget on the device, and whether the device's memory ran out).
_ADDED_V8 = ("gpu_budget_bytes", "gpu_out_of_memory")
#: Columns added in schema version 9 (the kernel CPU time of a run's thread: page faults, zeroing).
_ADDED_V9 = ("sys_seconds",)
#: Columns added in schema version 10 (what a run left held in its worker process: a library's first use).
_ADDED_V10 = ("retained_bytes",)
#: Columns added in schema version 12 (whether a run was its worker process's first call of its operator).
_ADDED_V12 = ("first_call",)
#: Columns added in schema version 13 (when the runner submitted a run's task).
_ADDED_V13 = ("submitted_at",)
#: Columns added in schema version 15 (when in its run a run's memory reached half and 90% of its peak).
_ADDED_V15 = ("rise_50", "rise_90")


def _table_sql(table: str, columns: list[tuple[str, str]], index: str, index_column: str) -> str:
    """``CREATE TABLE`` of ``table`` (an autoincrement ``id`` plus ``columns``) and its index on
    ``(index_column, id)``, as ``;``-separated statements."""
    return (f"CREATE TABLE {table} (id INTEGER PRIMARY KEY AUTOINCREMENT, "
            + ", ".join(f"{c} {t}" for c, t in columns)
            + f");\nCREATE INDEX {index} ON {table}({index_column}, id);\n")


#: The learned policy's rewards (schema v4): one row per finished plan (see ``records.Reward``).
_REWARD_COLUMNS: list[tuple[str, str]] = [
    ("operator_key", "TEXT NOT NULL"),
    ("arm", "TEXT NOT NULL"),
    ("arms", "TEXT NOT NULL"),  # comma-separated
    ("reward", "REAL NOT NULL"),
    ("efficiency", "REAL NOT NULL"),
    ("elements", "INTEGER NOT NULL"),
    ("wall_seconds", "REAL NOT NULL"),
    ("slots", "INTEGER NOT NULL"),
    ("out_of_memory", "INTEGER NOT NULL"),
    ("n_chunks", "INTEGER NOT NULL"),
    ("flow_run_id", "TEXT NOT NULL"),
    ("created_at", "REAL NOT NULL"),
]
REWARD_COLUMN_NAMES = [c for c, _ in _REWARD_COLUMNS]
_CREATE_REWARDS = _table_sql("rewards", _REWARD_COLUMNS, "rewards_key", "operator_key")


#: The chunked maps of each flow run (schema v5): one row per map (see ``records.MapRun``).
_MAP_COLUMNS: list[tuple[str, str]] = [
    ("flow_run_id", "TEXT NOT NULL"),
    ("operator", "TEXT NOT NULL"),
    ("operator_key", "TEXT NOT NULL"),
    ("source", "TEXT NOT NULL"),
    ("source_bytes", "INTEGER"),
    ("output_path", "TEXT NOT NULL"),
    ("shape", "TEXT NOT NULL"),  # "ni,nx,nt"
    ("halo", "TEXT NOT NULL"),  # "hi,hx,ht"
    ("itemsize", "INTEGER NOT NULL"),
    ("slots", "INTEGER NOT NULL"),
    ("budget_bytes", "INTEGER NOT NULL"),
    ("started_at", "REAL NOT NULL"),
    ("ended_at", "REAL NOT NULL"),
    ("outcome", "TEXT NOT NULL"),
    ("map_id", "TEXT NOT NULL DEFAULT ''"),
    ("params", "TEXT"),
    ("whole_traces", "INTEGER"),
    ("workers", "INTEGER"),
    ("threads_per_worker", "INTEGER"),
    ("memory_limit_bytes", "INTEGER"),
    ("kill_fraction", "REAL"),
    ("resting_bytes", "INTEGER"),
    ("threads_per_core", "REAL"),
]
MAP_COLUMN_NAMES = [c for c, _ in _MAP_COLUMNS]
#: ``maps`` columns added in schema version 11 (what a simulation of the map on another cluster needs).
_ADDED_MAPS_V11 = ("params", "whole_traces", "workers", "threads_per_worker", "memory_limit_bytes", "kill_fraction",
                   "resting_bytes")
#: ``maps`` columns added in schema version 14 (the worker threads per CPU core the map's budget counted).
_ADDED_MAPS_V14 = ("threads_per_core",)
# What each host that ran a task is (CPU, memory, system), for traces: one row per host name.
_CREATE_MACHINES = "CREATE TABLE machines (host TEXT PRIMARY KEY, info TEXT NOT NULL, updated_at REAL NOT NULL);\n"
# The v5 layout of maps and machines (what migrate_4_to_5 writes; migrate_10_to_11 and migrate_13_to_14 add the
# v11 and v14 columns to maps).
_CREATE_V5 = (_table_sql("maps", [c for c in _MAP_COLUMNS if c[0] not in _ADDED_MAPS_V11 + _ADDED_MAPS_V14], "maps_run",
                         "flow_run_id")
              + _CREATE_MACHINES)


def _create_table(columns: list[tuple[str, str]]) -> str:
    return (_table_sql("observations", columns, "observations_key", "operator_key")
            + "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);\n")


_CREATE = (_create_table(_COLUMNS) + _CREATE_REWARDS + _table_sql("maps", _MAP_COLUMNS, "maps_run", "flow_run_id")
           + _CREATE_MACHINES)
# The v2 layout (what migrate_1_to_2 writes; migrate_2_to_3 adds the v3 columns to it).
_CREATE_V2 = _create_table([c for c in _COLUMNS if c[0] not in _ADDED_V3 + _ADDED_V5 + _ADDED_V6 + _ADDED_V7
                                                                 + _ADDED_V8 + _ADDED_V9 + _ADDED_V10 + _ADDED_V12
                                                                 + _ADDED_V13 + _ADDED_V15])

# The v1 layout, kept to document what migrate_1_to_2 reads (and for the migration test).
CREATE_V1 = (
    "CREATE TABLE observations (id INTEGER PRIMARY KEY AUTOINCREMENT, operator_key TEXT NOT NULL, "
    "elements INTEGER NOT NULL, extents TEXT NOT NULL, bytes_in INTEGER NOT NULL, "
    "peak_bytes INTEGER NOT NULL, seconds REAL NOT NULL, outcome TEXT NOT NULL, "
    "censored INTEGER NOT NULL, worker TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL);\n"
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);\n"
)


def _migrate_1_to_2(con: sqlite3.Connection) -> None:
    """v1 kept extents as one text column ``"IxXxT"`` and lacked the newer fields."""
    con.execute("ALTER TABLE observations RENAME TO observations_v1")
    _execute_script(con, _CREATE_V2)
    rows = con.execute("SELECT id, operator_key, elements, extents, bytes_in, peak_bytes, seconds, outcome, "
                       "censored, worker, created_at FROM observations_v1 ORDER BY id").fetchall()
    for (rid, key, elements, extents, bytes_in, peak, seconds, outcome, censored, worker, created) in rows:
        try:
            il, xl, tw = (int(v) for v in str(extents).lower().split("x"))
        except ValueError:
            il, xl, tw = 1, 1, int(elements)
        con.execute(
            "INSERT INTO observations (id, operator_key, elements, extent_iline, extent_xline, extent_twt, "
            "bytes_in, peak_bytes, seconds, outcome, censored, cpu_seconds, worker, chunk, budget_bytes, "
            "gpu_peak_bytes, energy_joules, shared, method, flow_run_id, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?, '', NULL, NULL, NULL, 0, '', '', ?)",
            (rid, key, elements, il, xl, tw, bytes_in, peak, seconds, outcome, censored, worker or "", created))
    con.execute("DROP TABLE observations_v1")


def _migrate_2_to_3(con: sqlite3.Connection) -> None:
    """v3 adds what the worker held when a run started and what the budget assumed (NULL for older rows)."""
    for name in _ADDED_V3:
        con.execute(f"ALTER TABLE observations ADD COLUMN {name} INTEGER")


def _execute_script(con: sqlite3.Connection, script: str) -> None:
    """Run ``;``-separated statements one by one (``executescript`` would COMMIT the open transaction)."""
    for stmt in script.split(";\n"):
        if stmt.strip():
            con.execute(stmt)


def _migrate_3_to_4(con: sqlite3.Connection) -> None:
    """v4 adds the learned policy's rewards (an empty table: older stores start the policy from scratch)."""
    _execute_script(con, _CREATE_REWARDS)


def _migrate_4_to_5(con: sqlite3.Connection) -> None:
    """v5 adds what a trace of a run needs: energy's source, start, task run and host per observation
    (NULL / '' for older rows), the maps of each flow run and the machines tasks ran on (empty tables)."""
    for name, kind in _COLUMNS:
        if name in _ADDED_V5:
            con.execute(f"ALTER TABLE observations ADD COLUMN {name} {kind}")
    _execute_script(con, _CREATE_V5)


def _migrate_5_to_6(con: sqlite3.Connection) -> None:
    """v6 adds what other runs on the worker held when a run started (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V6)


def _migrate_6_to_7(con: sqlite3.Connection) -> None:
    """v7 adds how far a run took the worker above the most it had held (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V7)


def _migrate_7_to_8(con: sqlite3.Connection) -> None:
    """v8 adds a GPU map's device budget (NULL for older rows) and whether the GPU ran out (0 for older rows:
    before v8 no run was told apart as a GPU out-of-memory)."""
    _add_columns(con, _ADDED_V8)


def _migrate_8_to_9(con: sqlite3.Connection) -> None:
    """v9 adds a run's kernel CPU time (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V9)


def _migrate_9_to_10(con: sqlite3.Connection) -> None:
    """v10 adds what a run left held in its worker process (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V10)


def _migrate_10_to_11(con: sqlite3.Connection) -> None:
    """v11 adds to each map what a simulation of it on another cluster needs: its parameters, whether it keeps
    traces whole and the cluster's shape (NULL for older maps: a simulation asks for what it lacks)."""
    _add_map_columns(con, _ADDED_MAPS_V11)


def _migrate_11_to_12(con: sqlite3.Connection) -> None:
    """v12 adds whether a run was its worker process's first call of its operator (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V12)


def _migrate_12_to_13(con: sqlite3.Connection) -> None:
    """v13 adds when the runner submitted a run's task (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V13)


def _migrate_13_to_14(con: sqlite3.Connection) -> None:
    """v14 adds to each map the worker threads per CPU core its budget counted (NULL for older maps: a simulation
    counts them from the machines' recorded cores)."""
    _add_map_columns(con, _ADDED_MAPS_V14)


def _migrate_14_to_15(con: sqlite3.Connection) -> None:
    """v15 adds when in its run a run's memory reached half and 90% of its peak (NULL for older rows: unknown)."""
    _add_columns(con, _ADDED_V15)


def _add_map_columns(con: sqlite3.Connection, names: tuple[str, ...]) -> None:
    for name, kind in _MAP_COLUMNS:
        if name in names:
            con.execute(f"ALTER TABLE maps ADD COLUMN {name} {kind}")


def _add_columns(con: sqlite3.Connection, names: tuple[str, ...]) -> None:
    for name, kind in _COLUMNS:
        if name in names:
            con.execute(f"ALTER TABLE observations ADD COLUMN {name} {kind}")


MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _migrate_1_to_2, 2: _migrate_2_to_3,
                                                              3: _migrate_3_to_4, 4: _migrate_4_to_5,
                                                              5: _migrate_5_to_6, 6: _migrate_6_to_7,
                                                              7: _migrate_7_to_8, 8: _migrate_8_to_9,
                                                              9: _migrate_9_to_10, 10: _migrate_10_to_11,
                                                              11: _migrate_11_to_12, 12: _migrate_12_to_13,
                                                              13: _migrate_13_to_14, 14: _migrate_14_to_15}
"""``MIGRATIONS[v]`` turns a version-``v`` store into version ``v + 1`` (run inside one transaction)."""


class _Foreign(Exception):
    """The file is not one of our stores (internal: triggers moving it aside)."""


# --------------------------------------------------------------------------- the store


class Store:
    """The observation store: ``add``, ``add_many``, ``observations``, ``keys``, ``forget``, ``export``.

    ``path`` defaults to :func:`default_store_path`. ``journal_mode``:
    ``"auto"`` (WAL locally, DELETE on network filesystems), ``"wal"`` or
    ``"delete"``; ``$MEMCHUNK_STORE_JOURNAL`` sets the default. Thread-safe (one
    connection behind a lock); open one ``Store`` per process.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, journal_mode: str | None = None,
                 busy_timeout_ms: int = BUSY_TIMEOUT_MS):
        self.path = Path(path).expanduser() if path is not None else default_store_path()
        mode = (journal_mode or os.environ.get("MEMCHUNK_STORE_JOURNAL") or "auto").lower()
        if mode not in ("auto", "wal", "delete"):
            raise StoreError(f"journal_mode must be 'auto', 'wal' or 'delete', got {mode!r}")
        self.busy_timeout_ms = int(busy_timeout_ms)
        self._lock = threading.RLock()
        self._con: sqlite3.Connection | None = None
        self._make_dirs(self.path.parent)
        if mode == "auto":
            mode = "delete" if is_network_filesystem(self.path.parent) else "wal"
        self.journal_mode = mode
        try:
            self._open()
        except _Foreign as exc:
            self._move_aside(str(exc))
            self._open()

    # ------------------------------------------------------------------ opening

    @staticmethod
    def _make_dirs(directory: Path) -> None:
        missing = []
        d = directory
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreError(f"cannot create the store directory {d}: {exc}; "
                                 "set MEMCHUNK_STORE to a writable path") from exc

    def _open(self) -> None:
        if self.path.is_dir():
            raise StoreError(f"the store path {self.path} is a directory; give a file path, "
                             f"e.g. {self.path / 'observations.sqlite'}")
        if not self.path.exists():
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
                os.close(fd)
            except OSError as exc:
                raise StoreError(f"cannot create the store {self.path}: {exc}; "
                                 "set MEMCHUNK_STORE to a writable path") from exc
        try:
            con = sqlite3.connect(str(self.path), timeout=self.busy_timeout_ms / 1000,
                                  isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        try:
            con.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
            version = con.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if version > SCHEMA_VERSION:
                con.close()
                raise StoreSchemaTooNewError(
                    f"the store {self.path} has schema version {version}, newer than the {SCHEMA_VERSION} this "
                    f"memchunk-prefect reads; upgrade memchunk-prefect, or point MEMCHUNK_STORE (or store=) "
                    "at another file. The store was not modified.")
            if version == 0 and not tables:
                self._set_journal(con)
                self._create(con)
            elif version == 0 or "observations" not in tables or not self._is_ours(con):
                con.close()
                raise _Foreign(f"a SQLite database without memchunk tables (user_version={version}, "
                               f"tables={sorted(tables)})")
            else:
                self._set_journal(con)
                if version < SCHEMA_VERSION:
                    self._migrate(con, version)
        except sqlite3.OperationalError as exc:  # locked, unreadable, a directory: not the file's fault
            con.close()
            raise StoreError(f"cannot use the store {self.path}: {exc}; check the path and its permissions, "
                             "or set MEMCHUNK_STORE to another file") from exc
        except sqlite3.DatabaseError as exc:  # "file is not a database", "malformed": the file is bad
            con.close()
            raise _Foreign(f"not a readable SQLite database ({exc})") from None
        self._con = con

    def _set_journal(self, con: sqlite3.Connection) -> None:
        got = con.execute(f"PRAGMA journal_mode = {self.journal_mode.upper()}").fetchone()[0]
        self.journal_mode_in_effect = str(got).lower()

    @staticmethod
    def _is_ours(con: sqlite3.Connection) -> bool:
        try:
            row = con.execute("SELECT value FROM meta WHERE name = 'application'").fetchone()
        except sqlite3.OperationalError:
            return False
        return row is not None and row[0] == APPLICATION

    def _create(self, con: sqlite3.Connection) -> None:
        con.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have created it between our check and the lock.
            if con.execute("PRAGMA user_version").fetchone()[0] == 0:
                _execute_script(con, _CREATE)
                con.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('application', ?)", (APPLICATION,))
                con.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('created_at', ?)", (str(time.time()),))
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            con.execute("COMMIT")
        except BaseException:
            _rollback(con)
            raise

    def _migrate(self, con: sqlite3.Connection, version: int) -> None:
        con.execute("BEGIN IMMEDIATE")
        try:
            version = con.execute("PRAGMA user_version").fetchone()[0]  # re-read under the lock
            while version < SCHEMA_VERSION:
                step = MIGRATIONS.get(version)
                if step is None:
                    raise StoreError(f"no migration from schema version {version} of {self.path}; "
                                     "move the file aside to start a fresh store")
                step(con)
                version += 1
                con.execute(f"PRAGMA user_version = {version}")
            con.execute("COMMIT")
        except BaseException:
            _rollback(con)
            raise

    def _move_aside(self, why: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        i = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{i}")
            i += 1
        try:
            os.replace(self.path, target)
            for suffix in ("-wal", "-shm", "-journal"):
                side = Path(str(self.path) + suffix)
                if side.exists():
                    os.replace(side, Path(str(target) + suffix))
        except FileNotFoundError:
            pass  # another process moved it first
        except OSError as exc:
            raise StoreError(f"the store {self.path} is unusable ({why}) and could not be moved aside: {exc}; "
                             "move or delete it by hand") from exc
        warnings.warn(f"the memchunk store {self.path} was unusable ({why}); it was moved to {target} "
                      "and a fresh store begins (learned memory starts from scratch)",
                      StoreMovedAsideWarning, stacklevel=3)

    # ------------------------------------------------------------------ API

    @property
    def _connection(self) -> sqlite3.Connection:
        if self._con is None:
            raise StoreError(f"the store {self.path} is closed")
        return self._con

    @staticmethod
    def _row(obs: Observation) -> tuple:
        il, xl, tw = obs.extents
        return (obs.operator_key, obs.elements, il, xl, tw, obs.bytes_in, obs.peak_bytes, float(obs.seconds),
                obs.outcome, int(bool(obs.censored)), obs.cpu_seconds, obs.worker, obs.chunk, obs.budget_bytes,
                obs.gpu_peak_bytes, obs.energy_joules, int(bool(obs.shared)), obs.method, obs.flow_run_id,
                float(obs.created_at), obs.baseline_bytes, obs.resting_bytes, obs.energy_source, obs.started_at,
                obs.task_run_id or "", obs.host or "", obs.map_id or "", obs.others_bytes, obs.grew_bytes,
                obs.gpu_budget_bytes, int(bool(obs.gpu_out_of_memory)), obs.sys_seconds, obs.retained_bytes,
                None if obs.first_call is None else int(bool(obs.first_call)), obs.submitted_at,
                obs.rise_50, obs.rise_90)

    @staticmethod
    def _observation(row: Iterable[Any]) -> Observation:
        d = dict(zip(COLUMN_NAMES, row))
        d["extents"] = (d.pop("extent_iline"), d.pop("extent_xline"), d.pop("extent_twt"))
        d["censored"] = bool(d["censored"])
        d["shared"] = bool(d["shared"])
        d["gpu_out_of_memory"] = bool(d["gpu_out_of_memory"])
        d["first_call"] = None if d["first_call"] is None else bool(d["first_call"])
        return Observation.from_dict(d)

    def add(self, obs: Observation) -> int:
        """Append one observation; returns its row id (increasing in insertion order)."""
        return self.add_many([obs])[-1]

    def add_many(self, observations: Iterable[Observation]) -> list[int]:
        """Append observations in one transaction; returns their row ids."""
        return self._insert("observations", COLUMN_NAMES, [self._row(o) for o in observations])

    def _insert(self, table: str, columns: list[str], rows: list[tuple]) -> list[int]:
        """Append ``rows`` to ``table`` in one ``BEGIN IMMEDIATE`` transaction; returns their row ids."""
        sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
        with self._lock:
            con = self._connection
            con.execute("BEGIN IMMEDIATE")
            try:
                ids = [int(con.execute(sql, r).lastrowid or 0) for r in rows]
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
        return ids

    def _select(self, table: str, columns: list[str], key: str | None, after: int, *,
                flow_run_id: str | None = None) -> list[tuple]:
        """``(id, *columns)`` rows of ``table`` in insertion order, optionally for one key (and/or one flow
        run) and after a row id."""
        sql = f"SELECT id, {', '.join(columns)} FROM {table} WHERE id > ?"
        args: list[Any] = [after]
        if key is not None:
            sql += " AND operator_key = ?"
            args.append(key)
        if flow_run_id is not None:
            sql += " AND flow_run_id = ?"
            args.append(str(flow_run_id))
        with self._lock:
            return self._connection.execute(sql + " ORDER BY id", args).fetchall()

    def rows(self, key: str | None = None, *, after: int = 0) -> Iterator[tuple[int, Observation]]:
        """``(row id, Observation)`` in insertion order, optionally for one key and after a row id."""
        for r in self._select("observations", COLUMN_NAMES, key, after):
            yield r[0], self._observation(r[1:])

    def run_observations(self, flow_run_id: str) -> list[Observation]:
        """Every observation of one flow run, in insertion order."""
        return [self._observation(r[1:]) for r in self._select("observations", COLUMN_NAMES, None, 0,
                                                                flow_run_id=flow_run_id)]

    def add_map(self, run: MapRun) -> int:
        """Record one chunked map of a flow run (written when the map ends); returns its row id."""
        d = run.to_dict()
        d["shape"] = ",".join(str(v) for v in run.shape)
        d["halo"] = ",".join(str(v) for v in run.halo)
        return self._insert("maps", MAP_COLUMN_NAMES, [tuple(d[c] for c in MAP_COLUMN_NAMES)])[0]

    def maps(self, flow_run_id: str | None = None) -> list[MapRun]:
        """The chunked maps recorded (of one flow run, if given), in the order they ended."""
        out = []
        for r in self._select("maps", MAP_COLUMN_NAMES, None, 0, flow_run_id=flow_run_id):
            d = dict(zip(MAP_COLUMN_NAMES, r[1:]))
            d["shape"] = tuple(int(v) for v in str(d["shape"]).split(","))
            d["halo"] = tuple(int(v) for v in str(d["halo"]).split(","))
            out.append(MapRun.from_dict(d))
        return out

    def put_machines(self, machines: Mapping[str, Mapping[str, Any]]) -> None:
        """Record what each host is (``{host: info}``, JSON-able), replacing an older description."""
        rows = [(str(h), json.dumps(dict(info), sort_keys=True), time.time()) for h, info in machines.items()]
        if not rows:
            return
        with self._lock:
            con = self._connection
            con.execute("BEGIN IMMEDIATE")
            try:
                con.executemany("INSERT OR REPLACE INTO machines (host, info, updated_at) VALUES (?, ?, ?)", rows)
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise

    def machines(self) -> dict[str, dict[str, Any]]:
        """``{host: info}`` for every host recorded."""
        with self._lock:
            rows = self._connection.execute("SELECT host, info FROM machines ORDER BY host").fetchall()
        return {str(h): json.loads(info) for h, info in rows}

    def observations(self, key: str | None = None) -> list[Observation]:
        """All observations (of ``key``, if given) in insertion order."""
        return [o for _, o in self.rows(key)]

    def keys(self) -> list[str]:
        """Operator keys with at least one observation, sorted."""
        with self._lock:
            return [r[0] for r in self._connection.execute(
                "SELECT DISTINCT operator_key FROM observations ORDER BY operator_key")]

    def count(self, key: str | None = None) -> int:
        with self._lock:
            if key is None:
                return self._connection.execute("SELECT COUNT(*) FROM observations").fetchone()[0]
            return self._connection.execute("SELECT COUNT(*) FROM observations WHERE operator_key = ?",
                                            (key,)).fetchone()[0]

    def add_reward(self, reward: Reward) -> int:
        """Append one learned-policy reward; returns its row id."""
        d = reward.to_dict()
        d["arms"] = ",".join(reward.arms)
        return self._insert("rewards", REWARD_COLUMN_NAMES, [tuple(d[c] for c in REWARD_COLUMN_NAMES)])[0]

    def reward_rows(self, key: str | None = None, *, after: int = 0) -> list[tuple[int, Reward]]:
        """``(row id, Reward)`` in insertion order, optionally for one key and after a row id."""
        out = []
        for r in self._select("rewards", REWARD_COLUMN_NAMES, key, after):
            d = dict(zip(REWARD_COLUMN_NAMES, r[1:]))
            d["arms"] = tuple(a for a in str(d["arms"]).split(",") if a)
            out.append((int(r[0]), Reward.from_dict(d)))
        return out

    def rewards(self, key: str | None = None) -> list[Reward]:
        """All learned-policy rewards (of ``key``, if given) in insertion order."""
        return [r for _, r in self.reward_rows(key)]

    def retract(self, observations: Sequence[Observation]) -> int:
        """Delete the rows of ``observations`` (matched by flow run, map, chunk, outcome, method and creation
        time: an observation has no row id of its own); returns how many rows were deleted."""
        sql = ("DELETE FROM observations WHERE flow_run_id = ? AND map_id = ? AND chunk = ? AND outcome = ? "
               "AND method = ? AND created_at = ?")
        with self._lock:
            con = self._connection
            con.execute("BEGIN IMMEDIATE")
            try:
                n = sum(con.execute(sql, (o.flow_run_id, o.map_id, o.chunk, o.outcome, o.method,
                                          o.created_at)).rowcount for o in observations)
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
        return n

    def forget(self, key: str) -> int:
        """Delete every observation and policy reward of ``key``; returns how many observations were deleted."""
        with self._lock:
            con = self._connection
            con.execute("BEGIN IMMEDIATE")
            try:
                con.execute("DELETE FROM rewards WHERE operator_key = ?", (key,))
                n = con.execute("DELETE FROM observations WHERE operator_key = ?", (key,)).rowcount
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
        return n

    def compact(self, keep: int, key: str | None = None) -> dict[str, int]:
        """Trim each operator key's history (``key``'s only, if given); returns the rows deleted, per table.

        Kept per key: the newest ``keep`` observations, and besides them the newest observation of each
        (size, outcome) pair, for the newest ``keep`` pairs; the newest ``keep`` policy rewards of each arm;
        the map records that still have an observation, or that ended within the newest ``keep``
        observations' time (a map with none, resumed from its markers, is kept while it is recent). Everything
        else is deleted.

        Why a cap: a model is rebuilt by replaying its key's rows at each flow run's first map (about 0.5 ms
        a row), and a nightly map of thousands of chunks would otherwise make that replay grow without end.
        Why not just the newest rows: once warm, a nightly plan repeats one chunk size, and the newest rows
        would all be of that size; the model needs two sizes to separate a fixed overhead from a per-element
        cost, so it would go back to "not ready" and probe again (seen on the 21st night of
        ``benchmarks.studies.consecutive --keep 20``); an arm of the learned policy whose rewards all went would look
        untried and be explored again. SQLite reuses the freed pages, so the file stops growing once every
        key is at its cap (it does not shrink: ``VACUUM`` would need every other connection closed).
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise StoreError(f"compact: keep must be a whole number of rows of at least 1, got {keep!r}")
        deleted = {"observations": 0, "rewards": 0, "maps": 0}
        with self._lock:
            con = self._connection
            keys = [key] if key is not None else [r[0] for r in con.execute(
                "SELECT DISTINCT operator_key FROM observations UNION SELECT DISTINCT operator_key FROM rewards")]
            con.execute("BEGIN IMMEDIATE")
            try:
                for k in keys:
                    # Older than the keep-th newest row, unless it is the newest of its (size, outcome).
                    deleted["observations"] += con.execute(
                        "DELETE FROM observations WHERE operator_key = ? AND id <= (SELECT id FROM observations "
                        "WHERE operator_key = ? ORDER BY id DESC LIMIT 1 OFFSET ?) AND id NOT IN (SELECT MAX(id) "
                        "FROM observations WHERE operator_key = ? GROUP BY elements, outcome ORDER BY MAX(id) DESC "
                        "LIMIT ?)", (k, k, keep, k, keep)).rowcount
                    # Per arm: older than the arm's keep-th newest reward.
                    deleted["rewards"] += con.execute(
                        "DELETE FROM rewards WHERE operator_key = ? AND id IN (SELECT id FROM (SELECT id, "
                        "ROW_NUMBER() OVER (PARTITION BY arm ORDER BY id DESC) AS newer FROM rewards "
                        "WHERE operator_key = ?) WHERE newer > ?)", (k, k, keep)).rowcount
                    # The window of the newest keep observations starts at the keep-th newest one's time.
                    row = con.execute("SELECT MIN(created_at) FROM (SELECT created_at FROM observations "
                                      "WHERE operator_key = ? ORDER BY id DESC LIMIT ?)", (k, keep)).fetchone()
                    if row[0] is not None:
                        # Maps recorded before schema v5 have no map_id: what ended before any observation kept.
                        deleted["maps"] += con.execute(
                            "DELETE FROM maps WHERE operator_key = ? AND ended_at < ? AND (CASE WHEN map_id = '' "
                            "THEN ended_at < (SELECT MIN(created_at) FROM observations WHERE operator_key = ?) "
                            "ELSE map_id NOT IN (SELECT map_id FROM observations WHERE operator_key = ?) END)",
                            (k, row[0], k, k)).rowcount
                con.execute("COMMIT")
            except BaseException:
                _rollback(con)
                raise
        return deleted

    def schema_version(self) -> int:
        with self._lock:
            return self._connection.execute("PRAGMA user_version").fetchone()[0]

    def export(self, fmt: str = "csv", key: str | None = None) -> str:
        """All observations as CSV (one column per field, extents as three columns) or JSON (a list of objects)."""
        fmt = fmt.lower()
        rows = list(self.rows(key))
        if fmt == "json":
            return json.dumps([{"id": i, **o.to_dict()} for i, o in rows], indent=1)
        if fmt == "csv":
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["id"] + COLUMN_NAMES)
            for i, o in rows:
                w.writerow([i] + ["" if v is None else v for v in self._row(o)])
            return buf.getvalue()
        raise StoreError(f"export format must be 'csv' or 'json', got {fmt!r}")

    def copy_as_of(self, to: str | os.PathLike, until: float, *, keep_flow_run: str = "") -> Path:
        """A copy of this store at ``to`` holding what it held at ``until`` (epoch seconds): the observations and
        rewards written by then and the maps that had ended by then (a map's record is written as it ends), plus
        every map of ``keep_flow_run`` (its record, without what it taught). What a past flow run is predicted
        from, out of sample: the store as it stood when the run started
        (:func:`memchunk_prefect.sim.track.track_record`). ``to`` is replaced; it cannot be this store's own file
        (StoreError)."""
        dest = Path(to)
        if dest.resolve() == self.path.resolve():
            raise StoreError(f"a copy of the store {self.path} as of a time cannot replace the store itself: give "
                             "another path")
        dest.unlink(missing_ok=True)
        with self._lock:
            dst = sqlite3.connect(dest)
            try:
                self._connection.backup(dst)
                dst.execute("DELETE FROM observations WHERE created_at > ?", (float(until),))
                dst.execute("DELETE FROM rewards WHERE created_at > ?", (float(until),))
                dst.execute("DELETE FROM maps WHERE ended_at > ? AND flow_run_id != ?",
                            (float(until), str(keep_flow_run)))
                dst.commit()
            finally:
                dst.close()
        return dest

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}, journal_mode={self.journal_mode!r})"


def _rollback(con: sqlite3.Connection) -> None:
    """Roll back the open transaction, if any, without masking the exception being handled.

    An interrupt (Ctrl-C, a cancellation) can land after COMMIT ran: a bare ROLLBACK
    would then raise "no transaction is active" and replace the KeyboardInterrupt,
    which callers that keep a run going on store errors would swallow.
    """
    if con.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            con.execute("ROLLBACK")
