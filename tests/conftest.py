from types import ModuleType

import pytest
import torch

from rnndrop.kernels import compiled


@pytest.fixture(autouse=True, scope="session")
def compiled_kernel() -> ModuleType | None:
    """The compiled loop kernel's extension, built (or loaded from torch's cache) once, before the
    first test: a build takes minutes, and ``kernel="auto"`` layers in most test modules run it.
    None where it cannot be built (``RNNDROP_NO_COMPILE``, no compiler): the tests of the kernel
    itself then fail with the reason (:func:`needs_compiled_kernel`), the others run "manual"."""
    try:
        return compiled.build()
    except RuntimeError:
        return None


@pytest.fixture
def needs_compiled_kernel(compiled_kernel: ModuleType | None) -> ModuleType:
    """The extension, or a failure saying why it cannot be built (CI has g++ and ninja)."""
    try:
        return compiled_kernel or compiled.build()
    except RuntimeError as error:
        pytest.fail(f"the compiled kernel must build here: {error}")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests' tensors are tiny: one thread is faster, and the suite shares 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One thread for the test, given back after it: a language-model test module asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")`` (the command line and a job's
    runs set their own thread count; the suite shares 2 cores and tiny models gain nothing
    from more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def corpus(tmp_path):
    """The tiny corpus of ``tests.lm_helpers``, written into ``tmp_path / "data"`` and loaded."""
    from rnndrop.lm.data.corpus import load_corpus
    from tests.lm_helpers import write_corpus

    return load_corpus(write_corpus(tmp_path / "data"))
