"""Test-session set-up shared by every test module.

Without a CUDA device the kernels run through Triton's interpreter, which must be switched on
before any ``@triton.jit`` function is defined, so this runs before hf_flash is imported.
Tests get the device from the ``device`` fixture below; tests/README.md describes the layout,
the markers that select the CPU and GPU suites, and the fixtures.

Two switches used by ``scripts/gpu_suite.sh`` on the GPU machine:

- ``HF_FLASH_SHARD=i/n`` keeps every n-th collected test starting at i, so n pytest processes
  share the GPU (Triton compilation is CPU-bound and runs in parallel across them);
- ``HF_FLASH_TEST_LOG=path`` appends each test's outcome (and a failure's traceback) to
  ``path`` as soon as it is known, so a run killed at its time limit still says what failed.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ON_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
    shard = os.environ.get("HF_FLASH_SHARD")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"HF_FLASH_SHARD={shard!r}: want i/n with 0 <= i < n")
        config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % count != index])
        items[:] = [it for i, it in enumerate(items) if i % count == index]


def pytest_runtest_logreport(report):
    path = os.environ.get("HF_FLASH_TEST_LOG")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    if report.when == "setup" and report.outcome == "skipped":
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper():8s} {report.duration:7.1f}s {report.nodeid} ({report.when})\n")
        if report.failed:
            f.write(str(report.longrepr) + "\n\n")


@pytest.fixture(scope="session")
def device() -> str:
    """Where tests put their tensors: "cuda" on a GPU machine, else "cpu" (the interpreter)."""
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture
def launches(monkeypatch):
    """Counts of forward and backward attention kernel launches (the host launchers that
    hf_flash's custom ops call)."""
    import functools

    from hf_flash.kernels import flash_bwd, flash_fwd

    counts = {"fwd": 0, "bwd": 0}

    def counting(key, launcher):
        @functools.wraps(launcher)
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return launcher(*args, **kwargs)

        return wrapper

    for module, name, key in ((flash_fwd, "flash_attn_forward", "fwd"),
                              (flash_bwd, "flash_attn_backward", "bwd")):  # fmt: skip
        monkeypatch.setattr(module, name, counting(key, getattr(module, name)))
    return counts


@pytest.fixture
def exclusive_gpu_memory():
    """For the tests that need tens of GB of GPU memory (the tensors past 2^31 elements): one at
    a time among the pytest processes sharing the GPU (the GPU suite's shards, xdist workers),
    through an exclusive lock on a file; the test's cached blocks go back to the driver before the
    lock is released, so the next holder finds the memory free."""
    import fcntl
    import gc
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "hf_flash-gpu-memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
