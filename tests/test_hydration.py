"""memchunk_prefect.hydration: a worker validates the flow's Prefect settings once per distinct settings."""

from __future__ import annotations

import pytest
from prefect.context import SettingsContext
from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

from memchunk_prefect import hydration


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
