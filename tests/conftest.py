"""Shared fixtures and markers: tensors of every dtype the stores must round-trip; everything under
end_to_end/ is marked slow; tests marked gpu skip cleanly without a CUDA device.

The device layer: a test runs on the CPU even on a machine with a GPU (the active accelerator is the host,
and processes the tests start inherit ``OFFLOAD_CORE_ACCELERATOR=cpu``), unless it is marked ``gpu`` (the
real accelerator) or uses the ``fake_gpu`` fixture (the fake accelerator, and the test is marked
``fake_gpu``); a hazard the fake accelerator saw fails the test."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

# What the tests start runs on the CPU too, GPU or not (a CLI test on a GPU machine would pick cuda:0).
os.environ["OFFLOAD_CORE_ACCELERATOR"] = "cpu"
# tests learn and calibrate however busy the machine running them is (tests of the busy rule set it themselves)
os.environ["OFFLOAD_CORE_BUSY_LOAD"] = "inf"

import pytest  # noqa: E402
import torch  # noqa: E402

from offload_core import devices  # noqa: E402
from offload_core.testing import round_trip_tensors  # noqa: E402

END_TO_END = Path(__file__).resolve().parent / "end_to_end"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


#: a test file whose tests are all slow says so in one line
SLOW_FILE = re.compile(r"^pytestmark = pytest\.mark\.slow$", re.MULTILINE)


def pytest_ignore_collect(collection_path, config):
    """With ``-m "not slow"`` the end_to_end/ folder and the files marked slow throughout are not even imported (the
    serve tests' client library alone took a sixth of the quick subset's imports)."""
    if config.getoption("markexpr").strip() != "not slow":
        return None
    if collection_path == END_TO_END:
        return True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return True if SLOW_FILE.search(collection_path.read_text()) else None
    return None


def pytest_collection_finish(session):
    """Every test module is imported now, and what they and torch, transformers, Hydra... hold lives as long as the
    session: frozen out of the collector's way, each ``gc.collect()`` (the ``fake_gpu`` fixture's at every teardown,
    each automatic full collection) walks only what the tests made since, not the ~10^6 objects before (a second a
    call on a loaded 2-core machine, a fifth of the quick subset's time). What a test makes is collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "fake_gpu" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.fake_gpu)
        if END_TO_END in item.path.parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def compose_run():
    """``compose_run(overrides)``: the config ``run.py`` composes from ``overrides`` (conf/config.yaml, every
    plugin's options registered), ready for :func:`offload_core.runner.job.run`."""
    from hydra import compose, initialize_config_dir

    from offload_core.runner.config import register_configs

    def make(overrides: list[str]):
        register_configs()
        with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None):
            return compose(config_name="config", overrides=overrides)

    return make


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """``saved(name)``: a tiny seeded checkpoint transformers saved (tests/checkpoints.py's MODELS), made once a
    session."""
    from tests.checkpoints import saved_models

    return saved_models(tmp_path_factory.mktemp("hf_saved"))


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return round_trip_tensors()


@pytest.fixture(autouse=True)
def _no_leftover_log_files():
    """A Hydra run in this process leaves a FileHandler on a logger for a log file under the test's tmp_path; once
    pytest removes that folder, a later test's warning fails reopening it (FileNotFoundError from logging). Each
    test's new file handlers go, closed, when it ends; and the loggers its logging configuration disabled (Hydra's
    ``disable_existing_loggers``) or stopped from propagating are as they were, so a later test's ``caplog`` sees
    them."""

    def loggers() -> list[logging.Logger]:
        found = logging.Logger.manager.loggerDict.values()
        return [logging.getLogger(), *(v for v in found if isinstance(v, logging.Logger))]

    before = {id(logger): (list(logger.handlers), logger.disabled, logger.propagate) for logger in loggers()}
    yield
    for logger in loggers():
        handlers, disabled, propagate = before.get(id(logger), ([], False, logger.propagate))
        logger.disabled, logger.propagate = disabled, propagate
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            if handler not in handlers:
                logger.removeHandler(handler)
                handler.close()


@pytest.fixture(autouse=True)
def _accelerator(request):
    """The host (no accelerator) for every test, the real one for tests marked gpu; ``fake_gpu`` installs its own."""
    if request.node.get_closest_marker("gpu"):
        from offload_core.devices.torch_backend import TorchAccelerator, detect

        found = detect()
        accelerator = TorchAccelerator(found) if found else devices.HOST
    else:
        accelerator = devices.HOST
    with devices.use(accelerator):
        yield accelerator


@pytest.fixture
def fake_gpu(_accelerator):
    """``fake_gpu(count=1, memory="1GiB", workspace=0)`` installs a fake accelerator of ``count`` devices (each taking
    ``workspace`` bytes at its first matrix product) for the rest of the test and returns it; the test fails if it saw a
    hazard (a buffer used, overwritten or freed before the event guarding it)."""
    import gc

    from offload_core.devices.fake import FakeAccelerator
    from offload_core.values import parse_size

    made: list = []
    stack: list = []

    def make(count: int = 1, memory: int | str = "1GiB", workspace: int = 0) -> FakeAccelerator:
        memory = parse_size(memory) if isinstance(memory, str) else memory
        accelerator = FakeAccelerator(count=count, memory=memory, workspace=workspace)
        accelerator.install()
        context = devices.use(accelerator)
        context.__enter__()
        made.append(accelerator)
        stack.append(context)
        return accelerator

    yield make
    gc.collect()
    gc.freeze()  # what outlived the test stays out of the next collection's walk (see pytest_collection_finish)
    for context in reversed(stack):
        context.__exit__(None, None, None)
    for accelerator in made:
        accelerator.uninstall()
    for accelerator in made:
        accelerator.check()
