"""Checkpoints that prove they are intact, run identity, locks, interrupts, load_model
(issue 15 findings 2, 3, 4, 5, 8 and the checkpoint parts of 6)."""

from dataclasses import replace

import pytest
import torch

from rnndrop.lm.checkpoint import load_model
from rnndrop.lm.corpus import load_corpus
from rnndrop.lm.train import train_run
from tests.lm_helpers import TINY, write_corpus

ONE = replace(TINY, epochs=1, mc_samples=0)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def corpus(tmp_path):
    return load_corpus(write_corpus(tmp_path / "data"))


def test_load_model_rebuilds_the_best_model_with_its_vocabulary(corpus, tmp_path):
    result = train_run(corpus, ONE, "tied", tmp_path / "run", seed=4, progress=False)
    run = load_model(tmp_path / "run")
    assert not run.model.training and run.regime == "tied" and run.config == ONE
    assert run.vocab.itos == corpus.vocab.itos and run.dropout == result["dropout"]
    assert run.epoch == result["best_epoch"] and run.path == tmp_path / "run" / "best.pt"
    with pytest.raises(AttributeError):
        run.epoch = 3  # frozen
    # The rebuilt model scores the test split exactly as the run did.
    from rnndrop.lm.corpus import batchify
    from rnndrop.lm.train import score

    test = score(run.model, batchify(corpus.test, ONE.eval_batch_size), ONE.bptt)
    assert test.nll == pytest.approx(result["test_nll"], rel=1e-6)
    assert load_model(tmp_path / "run" / "best.pt").vocab.itos == corpus.vocab.itos
