"""The published training settings, by name (``--config``).

The settings of Zaremba et al. 2014 and Gal & Ghahramani 2016, plus ``mini`` /
``cpu-200`` for the small offline corpora and ``sparse-vd-*`` for sparse variational
dropout; each with the dropout probability of every site and the grid searched on
the validation split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from rnndrop.lm.model.train_config import TrainConfig

__all__ = ["CONFIGS", "get_config"]


def _zaremba(p: float) -> dict[str, float]:
    return {"input": p, "between": p, "output": p} if p else {}


def _gal(p_embedding_hidden: float, p_input_output: float) -> dict[str, float]:
    # Gal & Ghahramani tie the embedding and recurrent probabilities, and the
    # input and output ones (their grid search).
    return {
        "embedding": p_embedding_hidden, "hidden": p_embedding_hidden,
        "input": p_input_output, "between": p_input_output, "output": p_input_output,
    }


_ZAREMBA_REF = "Zaremba, Sutskever & Vinyals 2014, Recurrent neural network regularization"
_GAL_REF = (
    "Gal & Ghahramani 2016, A theoretically grounded application of dropout in RNNs "
    "(their LM code, yaringal/BayesianRNN): Zaremba's settings + weight decay 1e-7 and "
    "grid-searched probabilities"
)

def _tied_grid(embedding: float, hidden: tuple[float, ...], rest: tuple[float, ...]):
    return tuple(
        {"embedding": embedding, "hidden": h, "input": r, "between": r, "output": r}
        for h, r in zip(hidden, rest)
    )


#: Small grids: three points per regime (none has nothing to search), chosen on validation.
#: The recurrent probability and the others grow together, from light to heavy dropout.
#: A grid whose best point was at one of its ends got one more point beyond that end
#: (naive: 0.75; untied, batch, gaussian, weight_drop: a lighter point).
_SMALL_GRID: dict[str, tuple[Mapping[str, float], ...]] = {
    "none": ({},),
    "naive": tuple(_zaremba(p) for p in (0.3, 0.5, 0.65, 0.75)),
    "tied": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    "untied": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    "batch": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    "gaussian": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    "gaussian_fixed": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    # alpha <= 1 is p <= 0.5: the grid's points stay inside the constraint
    "gaussian_kingma": _tied_grid(0.1, (0.05, 0.1, 0.2), (0.2, 0.3, 0.5)),
    "gaussian_kingma_layer": _tied_grid(0.1, (0.05, 0.1, 0.2), (0.2, 0.3, 0.5)),
    # DropConnect on W_hh drops single weights, not whole units: AWD-LSTM uses 0.5.
    "weight_drop": _tied_grid(0.1, (0.1, 0.2, 0.35, 0.5), (0.2, 0.3, 0.5, 0.65)),
}

_AWD_REF = (
    "Merity, Keskar & Socher 2017, Regularizing and optimizing LSTM language models (AWD-LSTM): "
    "3-layer LSTM, tied weights, DropConnect on W_hh, embedding / locked dropout, AR 2, TAR 1, "
    "variable-length BPTT, NT-ASGD (lr 30, n 5), fine-tuning; sized for 144k words on one CPU core"
)


def _awd(hidden: float, rest: tuple[float, float, float]) -> dict[str, float]:
    """AWD-LSTM's sites: word types, the word vectors (input), between layers, the recurrent
    site (W_hh for weight_drop, h_{t-1} for tied) and the last layer's output."""
    input_, between, output = rest
    return {"embedding": 0.1, "input": input_, "between": between, "hidden": hidden, "output": output}


#: AWD-LSTM's non-recurrent dropout (0.4 word vectors, 0.3 between layers, 0.4 output at 1150
#: units) scaled down for 400 units, from light to the paper's own values.
_AWD_REST = ((0.25, 0.2, 0.25), (0.3, 0.25, 0.3), (0.4, 0.3, 0.4))
#: Per regime, the recurrent probability grows with the rest: DropConnect drops single weights
#: of W_hh (the paper: 0.5 at 1150 units), Gal's tied mask whole units of h_{t-1} (0.2-0.3 in
#: his LMs), so the tied points are lighter.
_AWD_GRID: dict[str, tuple[Mapping[str, float], ...]] = {
    "weight_drop": tuple(_awd(h, r) for h, r in zip((0.3, 0.4, 0.5), _AWD_REST)),
    "tied": tuple(_awd(h, r) for h, r in zip((0.1, 0.15, 0.25), _AWD_REST)),
    "batch": tuple(_awd(h, r) for h, r in zip((0.1, 0.15, 0.25), _AWD_REST)),
}

CONFIGS: dict[str, TrainConfig] = {
    # Sized for ptb-mini (57k training words) on one CPU thread: a few minutes a run.
    "mini": TrainConfig(
        name="mini", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20, bptt=35,
        epochs=20, lr=20.0, lr_decay=4.0, decay_after=0, clip=0.25, init_scale=0.1,
        # Below 0.1 (after four epochs without improvement) validation no longer moves: stop.
        schedule="plateau", min_lr=0.1, eval_batch_size=10,
        dropout={"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5},
        grid=_SMALL_GRID, mc_samples=50,
        reference="small offline setting of this project (SGD and plateau decay as in "
        "pytorch/examples word_language_model)",
    ),
    # The mini model trained to convergence (for ptb-144k): the rate is divided by 4 after
    # every epoch that does not improve validation perplexity, and the run ends when it
    # would fall below 0.1 (after the fourth such epoch) or at the cap of 60 epochs.
    "cpu-200": TrainConfig(
        name="cpu-200", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20, bptt=35,
        epochs=60, lr=20.0, lr_decay=4.0, decay_after=0, clip=0.25, init_scale=0.1,
        schedule="plateau", min_lr=0.1, eval_batch_size=10,
        dropout={"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5},
        grid=_SMALL_GRID, mc_samples=50,
        reference="the mini model trained to convergence on validation perplexity (plateau "
        "decay down to a learning-rate floor)",
    ),
    # Sparse variational dropout on the mini model (Lobacheva et al. 2017): Adam at a
    # constant rate, looser clipping, KL warm-up from the regime. Train it with regime
    # sparse_vd, from scratch or fine-tuning a dense run (train_run(init_from=...)).
    "sparse-vd-mini": TrainConfig(
        name="sparse-vd-mini", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20,
        bptt=35, epochs=8, lr=2e-3, lr_decay=1.0, decay_after=0, clip=5.0, init_scale=0.1,
        optimizer="adam", eval_batch_size=10, mc_samples=0, select="objective",
        reference="Lobacheva, Chirkova & Vetrov 2017, Bayesian sparsification of recurrent "
        "neural networks (Adam, KL warm-up), sized as the mini config",
    ),
    # The sparse-VD recipe for ptb-144k (docs/sparse-vd-results.md): fine-tune a converged
    # cpu-200 tied run (--init-from) with Adam at a constant rate, the embedding and decoder
    # frozen, the KL at weight 0.5 (chosen on validation) warmed up over the first 3 epochs,
    # tied dropout kept on the other sites, the epoch of the lowest validation objective
    # kept. --kl-weight trades compression for perplexity.
    "sparse-vd-cpu-200": TrainConfig(
        name="sparse-vd-cpu-200", embedding_size=200, hidden_size=200, num_layers=2,
        batch_size=20, bptt=35, epochs=15, lr=1e-3, lr_decay=1.0, decay_after=0, clip=5.0,
        init_scale=0.1, optimizer="adam", eval_batch_size=10, mc_samples=0, select="objective",
        kl_weight=0.5, freeze=("embedding.", "decoder."),
        dropout={"embedding": 0.1, "input": 0.5, "between": 0.5, "output": 0.5},
        reference="fine-tuning a dense tied model with sparse variational dropout (Lobacheva, "
        "Chirkova & Vetrov 2017: Adam, KL warm-up), sized as cpu-200",
    ),
    # AWD-LSTM's recipe (docs/language-models.md#the-awd-lstm-recipe) at a size whose ptb-144k
    # run fits a few hours on one CPU core: 3 x 400 LSTM, embedding 400 tied to the decoder, SGD
    # at lr 30 until validation stalls for 5 epochs, then the average of the weights (NT-ASGD),
    # up to 60 epochs, then up to 20 epochs of fine-tuning.
    # Train it with regime weight_drop (DropConnect on W_hh, the paper's) or tied (Gal's
    # recurrent masks), the rest equal.
    # BPTT 35, not the paper's 70: on 144k words an epoch at 70 has few steps, and at equal
    # words 35 learned faster on ptb-mini (measured: the same page, "BPTT 35").
    "awd": TrainConfig(
        name="awd", embedding_size=400, hidden_size=400, num_layers=3, batch_size=20, bptt=35,
        epochs=60, lr=30.0, lr_decay=1.0, decay_after=0, clip=0.25, init_scale=0.1,
        weight_decay=1.2e-6, schedule="fixed", eval_batch_size=10, tie_weights=True,
        dropout=_awd(0.4, _AWD_REST[1]), grid=_AWD_GRID, mc_samples=50,
        ar=2.0, tar=1.0, variable_bptt=True, nt_asgd=True, nonmono=5, finetune_epochs=20,
        reference=_AWD_REF,
    ),
    "zaremba-small": TrainConfig(
        name="zaremba-small", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20,
        bptt=20, epochs=13, lr=1.0, lr_decay=2.0, decay_after=4, clip=5.0, init_scale=0.1,
        dropout={}, reference=_ZAREMBA_REF + " (small, no dropout)",
    ),
    "zaremba-medium": TrainConfig(
        name="zaremba-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        dropout=_zaremba(0.5),
        reference=_ZAREMBA_REF + " (medium)",
    ),
    "zaremba-large": TrainConfig(
        name="zaremba-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=14, clip=10.0, init_scale=0.04,
        dropout=_zaremba(0.65),
        reference=_ZAREMBA_REF + " (large)",
    ),
    "gal-medium": TrainConfig(
        name="gal-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        weight_decay=1e-7, dropout=_gal(0.2, 0.35),
        reference=_GAL_REF + " (medium: 0.2 embedding/recurrent, 0.35 input/output)",
    ),
    "gal-large": TrainConfig(
        name="gal-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=10, clip=10.0, init_scale=0.04,
        weight_decay=1e-7, dropout=_gal(0.3, 0.5),
        reference=_GAL_REF + " (large: 0.3 embedding/recurrent, 0.5 input/output; decay "
        "after epoch 10 as in main_new_dropout_SOTA_v3.lua)",
    ),
}


def get_config(name: str) -> TrainConfig:
    try:  # a copy of its own (dropout and grid too): changing it leaves the preset as it is
        return replace(CONFIGS[name])
    except KeyError:
        raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {name!r}") from None
