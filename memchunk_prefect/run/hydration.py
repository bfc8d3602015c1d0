"""Prefect's settings context per chunk: serialized once per context in the flow, validated once per settings on
a worker.

In the flow (:func:`settings_serialized_once`, while maps run): prefect-dask serializes the flow's whole
context for every task run it submits; the settings part is memoized per context object.

On a worker (:func:`install`): prefect-dask sends every task run the flow's serialized context, and Prefect's
task engine rebuilds it on the worker before the task's function runs (``prefect.context.hydrated_context``).
The settings part is a dict of every Prefect setting, validated back into a ``prefect.settings.Settings`` by
pydantic-settings: some fifty nested settings models, each reading the environment, ``.env`` and
``prefect.toml`` sources, for values that the dict already fixes. Under cProfile that was 120 ms of the 178 ms
each task run spent on the worker before its function ran (Prefect 3.9, prefect-dask 0.3); unprofiled, a task's
submit-to-start latency on a local cluster was 0.12-0.13 s with it and 0.09 s without (``python -m
benchmarks.studies.task_start``). A chunked map pays that latency at every probe wave and every re-plan, in series, and
every chunk pays it in worker CPU.

:func:`install` wraps the task engine's ``hydrated_context`` in this worker process so that a serialized
settings context seen before is given the ``Settings`` validated the first time (keyed by its canonical
JSON: the same dict, the same settings); the first task run with new settings pays as before. Everything
else in the context is hydrated by Prefect as before. The worker side of a chunk
(:class:`memchunk_prefect.run.worker.BlockFunction`) installs it at its first chunk, and keeps that task run's
settings under the key of their own serialization, which is usually what the flow sent (serializing hydrated
settings gives back the same dict); where it is not (seen once in the full test suite), the worker's second
task run validates them once. Every later task run in the process with the same settings, chunks and other
Prefect tasks alike, gets the settings it would have been given, validated at most once. A Prefect whose
task engine has no ``hydrated_context`` is left alone.

The same wrapper keeps the task runs' Prefect API client. Prefect's task engine builds two new
``SyncPrefectClient`` objects for every task run it starts, one in ``hydrated_context`` (the flow run context's)
and one in ``SyncClientContext.get_or_create`` (the one its API calls go through), and each builds an SSL
context from certifi's CA bundle before its first request, even for an ``http://`` server: 17 ms each on an idle
machine, 40-50 ms while both cores compute (counted ad hoc on a worker of this repository's test cluster:
two per task run, both from those two places). Where the flow's settings name an API URL, the first task run on
a worker thread with those settings opens one client (Prefect's own ``get_client``, under those settings), and
every later one on that thread is given it: ``hydrated_context`` is handed it, and a ``SyncClientContext``
holding it is entered around the task run, which the task engine's ``get_or_create`` then uses (a Prefect
client is re-entrant: entered once when opened, it is never closed by a task run's exit). Prefect's own
long-lived clients (a flow run's, its events worker's) are used the same way across many requests, and Prefect
retries a request whose kept-alive connection the server closed. One client per worker thread (threads never
share one) and settings, :data:`CACHE_SIZE` at most per thread.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

#: Distinct settings kept per worker process (a worker serving flow runs with different settings).
CACHE_SIZE = 8

_LOCK = threading.Lock()
_CACHE: collections.OrderedDict[str, Any] = collections.OrderedDict()
_STATE: dict[str, Any] = {"original": None, "validated": 0, "reused": 0, "seeded": 0,
                          "clients_opened": 0, "clients_reused": 0, "generation": 0}
#: Per worker thread: ``(generation, {settings key: the client kept for it})``; a thread whose generation is
#: older than :func:`uninstall`'s forgets what it kept.
_LOCAL = threading.local()
#: Every client kept, in every thread (to close them all on :func:`uninstall`).
_OPEN: list[Any] = []


def install() -> bool:
    """Wrap ``prefect.task_engine.hydrated_context`` in this process (once); True when it is wrapped."""
    try:
        import prefect.task_engine as engine
    except Exception:  # noqa: BLE001 - no Prefect here: nothing to speed up
        return False
    with _LOCK:
        current = getattr(engine, "hydrated_context", None)
        if current is None:
            return False
        if getattr(current, "_memchunk_hydration", False):
            return True
        _STATE["original"] = current
        engine.hydrated_context = _hydrated_context
    _seed()
    return True


def _seed() -> None:
    """Keep the settings of the task run installing this (the worker's first chunk), under the key its own
    serialization gives: usually what the flow sent, so the next chunk's settings are found without validating."""
    with contextlib.suppress(Exception):  # no settings context, or one that does not serialize: nothing kept
        from prefect.context import SettingsContext

        ctx = SettingsContext.get()
        if ctx is None:
            return
        key = _key(ctx.serialize())
        with _LOCK:
            if key not in _CACHE:
                _CACHE[key] = ctx.settings
                _STATE["seeded"] += 1
                _trim()


def _key(settings_context: dict[str, Any]) -> str:
    """A serialized settings context's canonical JSON: equal contexts, equal keys."""
    return json.dumps(settings_context, sort_keys=True, default=str)


def _trim() -> None:
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def uninstall() -> None:
    """Restore Prefect's own ``hydrated_context`` and forget the settings kept (tests)."""
    import prefect.task_engine as engine

    with _LOCK:
        if _STATE["original"] is not None:
            engine.hydrated_context = _STATE["original"]
            _STATE["original"] = None
        _CACHE.clear()
        _STATE["validated"] = _STATE["reused"] = _STATE["seeded"] = 0
        _STATE["clients_opened"] = _STATE["clients_reused"] = 0
        _STATE["generation"] += 1
        clients, _OPEN[:] = list(_OPEN), []
    for client in clients:
        _close(client)


def stats() -> dict[str, int]:
    """Settings validated, reused and kept from the installing task run in this process since :func:`install`,
    and how many are kept."""
    with _LOCK:
        return {"validated": int(_STATE["validated"]), "reused": int(_STATE["reused"]),
                "seeded": int(_STATE["seeded"]), "kept": len(_CACHE)}


def client_stats() -> dict[str, int]:
    """API clients opened for task runs in this process since :func:`install` (one per worker thread and
    settings), task runs given one opened before, and how many of those kept are still open."""
    with _LOCK:
        return {"opened": int(_STATE["clients_opened"]), "reused": int(_STATE["clients_reused"]),
                "open": sum(not _closed(c) for c in _OPEN)}


def settings_for(settings_context: dict[str, Any], key: str | None = None) -> Any:
    """The ``Settings`` a serialized settings context validates to: validated once per distinct context.
    ``key``: the context's :func:`_key`, where the caller has it."""
    from prefect.context import SettingsContext

    key = _key(settings_context) if key is None else key
    with _LOCK:
        settings = _CACHE.get(key)
        if settings is not None:
            _CACHE.move_to_end(key)
            _STATE["reused"] += 1
            return settings
    settings = SettingsContext(**settings_context).settings  # outside the lock: another thread may do the same
    with _LOCK:
        _CACHE[key] = settings
        _STATE["validated"] += 1
        _trim()
    return settings


@contextlib.contextmanager
def _hydrated_context(serialized_context: dict[str, Any] | None = None, client: Any = None) -> Iterator[None]:
    original = _STATE["original"]
    kept = None
    settings_context = (serialized_context or {}).get("settings_context")
    if isinstance(settings_context, dict) and isinstance(settings_context.get("settings"), dict):
        with contextlib.suppress(Exception):  # anything unexpected: Prefect validates it as it always did
            key = _key(settings_context)
            settings = settings_for(settings_context, key)
            settings_context = {**settings_context, "settings": settings}
            serialized_context = {**(serialized_context or {}), "settings_context": settings_context}
            if client is None:
                kept = _kept_client(key, settings_context)
    if kept is None:
        with original(serialized_context, client):
            yield
        return
    from prefect.context import SyncClientContext

    with original(serialized_context, kept):
        # Built without __init__, which would open a client of its own (pydantic's model_construct: the fields
        # given, private attributes at their defaults); entered inside the flow's settings, as Prefect's is.
        with SyncClientContext.model_construct(client=kept):
            yield


def _kept_client(key: str, settings_context: dict[str, Any]) -> Any:
    """The API client this worker thread keeps for the settings of ``key`` (opened at the first task run with
    them); None where Prefect should open its own: the settings name no API URL (``get_client`` would start a
    server of its own), or a client context is already active in this thread (a task run inside another)."""
    from prefect.context import SettingsContext, SyncClientContext

    if SyncClientContext.get() is not None:
        return None
    held = getattr(_LOCAL, "held", None)
    if held is None or held[0] != _STATE["generation"]:
        held = _LOCAL.held = (_STATE["generation"], collections.OrderedDict())
    clients: collections.OrderedDict[str, Any] = held[1]
    client = clients.get(key)
    if client is not None:
        if not _closed(client):
            clients.move_to_end(key)
            with _LOCK:
                _STATE["clients_reused"] += 1
            return client
        _forget(clients.pop(key))  # closed by someone else: a new one below
    settings = settings_context["settings"]
    if not getattr(getattr(settings, "api", None), "url", None):
        return None
    from prefect.client.orchestration import get_client

    with SettingsContext(**settings_context):
        client = get_client(sync_client=True)
    client.__enter__()  # held open: each task run's context enters and exits it again, re-entrantly
    clients[key] = client
    with _LOCK:
        _STATE["clients_opened"] += 1
        _OPEN.append(client)
    while len(clients) > CACHE_SIZE:
        _, old = clients.popitem(last=False)
        _forget(old)
        _close(old)
    return client


def _forget(client: Any) -> None:
    with _LOCK:
        if client in _OPEN:
            _OPEN.remove(client)


def _closed(client: Any) -> bool:
    """Whether a Prefect client was closed (it cannot be opened again)."""
    return bool(getattr(client, "_closed", False))


def _close(client: Any) -> None:
    """Close a kept client (its connections), whatever state it is in."""
    with contextlib.suppress(Exception):
        client.__exit__(None, None, None)


_hydrated_context._memchunk_hydration = True  # type: ignore[attr-defined]


_SERIALIZE_LOCK = threading.Lock()
_SERIALIZE_USERS = 0
_SERIALIZE_ORIGINAL: Any = None


@contextlib.contextmanager
def settings_serialized_once() -> Iterator[None]:
    """While maps run, Prefect's settings context is serialized once per context object, not once per chunk.

    prefect-dask's submit serializes the flow's whole context for every task run
    it submits (``prefect.context.serialize_context``), and the settings part, a
    pydantic dump of every Prefect setting walked by ``visit_collection``, is most
    of a submission's cost in the flow: serializing the context took 88 ms of each 122 ms submit under
    cProfile, 11 ms once memoized (``python -m benchmarks.studies.map_overhead``), paid in the flow's thread, between
    chunk completions, for an answer that cannot change during a map (settings are
    fixed once a context is entered; cf. prefect#18191 on slow Dask task creation).
    ``SettingsContext.serialize`` is memoized per context object and secrets flag
    while at least one map runs (counted, so overlapping maps in threads install
    and remove it once), and restored after; a Prefect without that method is
    left alone.
    """
    global _SERIALIZE_USERS, _SERIALIZE_ORIGINAL
    from prefect.context import SettingsContext

    with _SERIALIZE_LOCK:
        if _SERIALIZE_USERS == 0:
            original = SettingsContext.__dict__.get("serialize")
            if original is None:  # a Prefect whose settings context serializes elsewhere: nothing to memoize
                _SERIALIZE_ORIGINAL = None
            else:
                _SERIALIZE_ORIGINAL = original
                cache: dict[tuple[int, bool], tuple[Any, dict]] = {}

                def serialize(self: Any, include_secrets: bool = True) -> dict:
                    key = (id(self), bool(include_secrets))
                    hit = cache.get(key)
                    if hit is None or hit[0] is not self:  # the object is kept, so an id is never reused
                        hit = cache[key] = (self, original(self, include_secrets=include_secrets))
                    return hit[1]

                SettingsContext.serialize = serialize  # type: ignore[method-assign]
        _SERIALIZE_USERS += 1
    try:
        yield
    finally:
        with _SERIALIZE_LOCK:
            _SERIALIZE_USERS -= 1
            if _SERIALIZE_USERS == 0 and _SERIALIZE_ORIGINAL is not None:
                SettingsContext.serialize = _SERIALIZE_ORIGINAL  # type: ignore[method-assign]
                _SERIALIZE_ORIGINAL = None
