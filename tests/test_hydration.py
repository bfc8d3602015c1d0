"""memchunk_prefect.run.hydration: a worker validates the flow's Prefect settings once per distinct settings."""

from __future__ import annotations

import pytest
from prefect.context import SettingsContext
from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

from memchunk_prefect.run import hydration


@pytest.fixture
def installed():
    import prefect.task_engine as engine

    hydration.uninstall()  # from a clean slate, whatever ran in this process before (a runner's in-process chunk)
    original = engine.hydrated_context
    assert not getattr(original, "_memchunk_hydration", False)
    assert hydration.install()
    yield engine
    hydration.uninstall()
    assert engine.hydrated_context is original, "uninstall must restore Prefect's own function"


def hydrated_settings(engine, serialized: dict):
    """The settings a task run sees inside the context the task engine hydrates from ``serialized``."""
    with engine.hydrated_context({"settings_context": serialized}):
        return SettingsContext.get().settings


def test_installing_keeps_the_current_task_runs_settings_and_a_task_run_with_them_reuses_them(installed):
    """Installed from inside a task run (a worker's first chunk), the settings it runs with are kept under the key of
    their own serialization, which is what the flow sends: the next task run with them validates nothing."""
    current = SettingsContext.get().settings
    assert hydration.stats() == {"validated": 0, "reused": 0, "seeded": 1, "kept": 1}
    sent = SettingsContext.get().serialize()  # what prefect-dask sends each task run
    assert hydrated_settings(installed, sent) is current
    assert hydration.stats() == {"validated": 0, "reused": 1, "seeded": 1, "kept": 1}
    assert hydration.install(), "installing again is a no-op"
    assert installed.hydrated_context is hydration._hydrated_context
    assert hydration.stats()["seeded"] == 1


def test_other_settings_are_validated_once_seen_as_they_are_and_then_reused(installed):
    current = SettingsContext.get().settings
    with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}):
        changed = SettingsContext.get().serialize()
    expected = SettingsContext(**changed).settings.model_dump()
    first = hydrated_settings(installed, changed)
    second = hydrated_settings(installed, dict(changed))  # an equal dict, as the next task run unpickles it
    assert first is not current and first.model_dump() == expected and first.logging.level == "ERROR"
    assert second is first, "equal serialized settings must reuse the settings validated the first time"
    assert current.logging.level != "ERROR"
    assert hydration.stats() == {"validated": 1, "reused": 1, "seeded": 1, "kept": 2}


def test_the_kept_settings_are_bounded(installed):
    base = SettingsContext.get().serialize()
    for i in range(hydration.CACHE_SIZE + 3):
        hydration.settings_for({**base, "profile": {**base["profile"], "name": f"profile-{i}"}})
    assert hydration.stats()["kept"] == hydration.CACHE_SIZE


def test_a_context_without_settings_is_hydrated_as_prefect_does(installed):
    with installed.hydrated_context({}):
        pass
    with installed.hydrated_context(None):
        pass
    assert hydration.stats() == {"validated": 0, "reused": 0, "seeded": 1, "kept": 1}


def clients_in(engine, serialized: dict):
    """The API clients a task run would use inside the context the task engine hydrates from ``serialized``: the
    flow run context's, the client context's (the task engine's ``get_or_create`` uses it), ``get_client``'s."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, SyncClientContext

    with engine.hydrated_context(serialized):
        flow_ctx = FlowRunContext.get()
        with SyncClientContext.get_or_create() as client_ctx:
            return (flow_ctx.client if flow_ctx else None), client_ctx.client, get_client(sync_client=True)


def test_task_runs_with_the_same_settings_on_one_thread_are_given_the_client_the_first_opened(installed,
                                                                                              prefect_server):
    """Prefect builds two clients per task run (each an SSL context); kept, the second task run on a thread with
    the same settings builds none: its client context, and get_client inside it, give the client opened first,
    which a task run's exit leaves open. Closed on uninstall."""
    sent = {"settings_context": SettingsContext.get().serialize()}
    assert SettingsContext.get().settings.api.url, "the session's Prefect server sets an API URL"
    first = clients_in(installed, sent)
    second = clients_in(installed, dict(sent))
    assert first[1] is second[1], "the second task run must be given the first's client"
    # (no flow run context here: that one, handed the same client, is seen in test_runner's flow runs)
    assert {id(c) for c in second if c is not None} == {id(kept := second[1])}, \
        "inside one task run, every client asked for is the kept one"
    assert not kept._closed and kept.api_healthcheck() is None, "a task run's exit must leave it open and usable"
    assert hydration.client_stats() == {"opened": 1, "reused": 1, "open": 1}
    hydration.uninstall()
    assert kept._closed and hydration.client_stats() == {"opened": 0, "reused": 0, "open": 0}


def test_threads_keep_clients_of_their_own_and_other_settings_get_another(installed, prefect_server):
    import threading

    sent = {"settings_context": SettingsContext.get().serialize()}
    with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}):
        other = {"settings_context": SettingsContext.get().serialize()}
    here = clients_in(installed, sent)[1]
    there: list = []
    thread = threading.Thread(target=lambda: there.extend([clients_in(installed, sent)[1],
                                                           clients_in(installed, sent)[1]]))
    thread.start()
    thread.join()
    assert there[0] is there[1] and there[0] is not here, "one client per thread, reused within it"
    assert clients_in(installed, other)[1] is not here, "other settings, another client"
    assert clients_in(installed, sent)[1] is here
    assert hydration.client_stats() == {"opened": 3, "reused": 2, "open": 3}


def test_no_client_is_kept_without_an_api_url_or_inside_another_client_context(installed, prefect_server):
    """Without an API URL Prefect's get_client would start a server of its own: left to Prefect. Inside a client
    context already active (a task run inside another), that one is used, as Prefect does."""
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_API_URL

    with temporary_settings({PREFECT_API_URL: None}):
        no_url = {"settings_context": SettingsContext.get().serialize()}
    assert not no_url["settings_context"]["settings"]["api"].get("url")
    with installed.hydrated_context(no_url):
        assert SyncClientContext.get() is None, "no client context is entered for Prefect"
    sent = {"settings_context": SettingsContext.get().serialize()}
    with SyncClientContext.get_or_create() as outer:
        assert clients_in(installed, sent)[1] is outer.client
    assert hydration.client_stats() == {"opened": 0, "reused": 0, "open": 0}
