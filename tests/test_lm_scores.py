"""The language-model scores against computations of their own: the perplexity and calibration
that ``rnndrop-lm`` reports (eval mode and Monte-Carlo) equal the whole stream run in one call,
its cross-entropy averaged over every token and its expected calibration error binned by hand.
Segments shorter than ``bptt``, the state carried between them and the confidence of each
prediction are where a score can go wrong without another score noticing."""

import math

import torch
import torch.nn.functional as F

from rnndrop.lm import RNNLanguageModel
from rnndrop.lm.data.corpus import bptt_batches
from rnndrop.lm.run.evaluate import score
from rnndrop.mc import mc_language_model_loss

VOCAB, ROWS, COLUMNS, BPTT, BINS = 30, 23, 3, 5, 10  # 22 targets a column: segments of 5, 5, 5, 5, 2


def _model_and_stream():
    torch.manual_seed(0)
    model = RNNLanguageModel(VOCAB, 8, 8, 2).eval()  # no dropout: every sample is the eval prediction
    with torch.no_grad():  # confident predictions, mostly wrong: confidences over five bins
        for parameter in model.parameters():
            parameter.mul_(6.0)
        model.decoder.weight.mul_(20.0)
    return model, torch.randint(VOCAB, (ROWS, COLUMNS))


def _whole_stream(model, stream):
    """The log-probabilities of every next word, the stream run in one call from a zero state."""
    with torch.no_grad():
        logits, _ = model(stream[:-1], None)
    return logits.log_softmax(-1), stream[1:]


def _ece_by_hand(log_probs, targets, bins):
    """Equal-width bins (i / bins, (i + 1) / bins] of the top word's probability; the ECE is the
    count-weighted mean of |accuracy - confidence| over the bins."""
    top, word = log_probs.exp().max(-1)
    top, right = top.flatten().double().tolist(), (word == targets).flatten().tolist()
    total = 0.0
    for b in range(bins):
        low = -1.0 if b == 0 else b / bins  # confidence 0 counts in the first bin
        members = [i for i, c in enumerate(top) if low < c <= (b + 1) / bins]
        if members:
            confidence = sum(top[i] for i in members) / len(members)
            accuracy = sum(right[i] for i in members) / len(members)
            total += len(members) * abs(accuracy - confidence)
    return total / len(top)


def test_the_eval_score_is_the_whole_streams_cross_entropy_and_calibration():
    """Every token weighs the same (the last, shorter segment too), the state is carried from
    segment to segment, and the calibration bins each token's top word by its probability over
    the vocabulary."""
    model, stream = _model_and_stream()
    log_probs, targets = _whole_stream(model, stream)
    expected_nll = float(F.nll_loss(log_probs.reshape(-1, VOCAB), targets.reshape(-1)))
    expected_ece = _ece_by_hand(log_probs, targets, BINS)
    assert expected_ece > 0.2  # a score that bins the wrong probabilities shows here
    got = score(model, stream, BPTT, calibration_bins=BINS)
    assert got.tokens == (ROWS - 1) * COLUMNS
    assert math.isclose(got.nll, expected_nll, rel_tol=1e-6)
    assert math.isclose(got.ece, expected_ece, rel_tol=1e-6, abs_tol=1e-9)


def test_the_monte_carlo_score_of_a_deterministic_model_is_the_eval_score():
    """Samples that are all the eval prediction average to it: the Monte-Carlo NLL and ECE of a
    model without dropout (strict=False) are the eval ones, for any sample count (the mean of S
    equal probabilities is that probability, not S times it)."""
    model, stream = _model_and_stream()
    log_probs, targets = _whole_stream(model, stream)
    expected_nll = float(F.nll_loss(log_probs.reshape(-1, VOCAB), targets.reshape(-1)))
    expected_ece = _ece_by_hand(log_probs, targets, BINS)
    for samples in (1, 4):
        loss = mc_language_model_loss(model, bptt_batches(stream, BPTT), samples, strict=False,
                                      calibration_bins=BINS)
        assert loss.num_tokens == (ROWS - 1) * COLUMNS
        assert math.isclose(loss.total_nll / loss.num_tokens, expected_nll, rel_tol=1e-5)
        assert math.isclose(loss.reliability.ece, expected_ece, rel_tol=1e-5, abs_tol=1e-7)


def test_the_eval_score_of_a_model_with_dropout_drops_nothing_and_leaves_its_mode():
    """score() evaluates in eval mode (the weight-scaling approximation) whatever mode the model
    is in, and gives the model back in that mode."""
    torch.manual_seed(0)
    model = RNNLanguageModel(VOCAB, 8, 8, 2, dropout_hidden=0.5, dropout_output=0.5).train()
    stream = torch.randint(VOCAB, (ROWS, COLUMNS))
    log_probs, targets = _whole_stream(model.eval(), stream)
    expected_nll = float(F.nll_loss(log_probs.reshape(-1, VOCAB), targets.reshape(-1)))
    got = score(model.train(), stream, BPTT)
    assert math.isclose(got.nll, expected_nll, rel_tol=1e-6) and model.training
