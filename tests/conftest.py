import pytest
import torch


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
