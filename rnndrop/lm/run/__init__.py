"""Layer 3 of ``rnndrop.lm``: training, evaluation, checkpoints, run folders, results, progress.

- :mod:`~rnndrop.lm.run.train`: one run, :func:`~rnndrop.lm.run.train.train_run` and its epoch loop;
- :mod:`~rnndrop.lm.run.recipe`: the rate schedule, BPTT segments, AR / TAR, NT-ASGD;
- :mod:`~rnndrop.lm.run.evaluate`: scoring (perplexity, Monte-Carlo, calibration) and sampling;
- :mod:`~rnndrop.lm.run.checkpoint`: what a run reads and writes (checkpoints, progress,
  identity, lock, results.json);
- :mod:`~rnndrop.lm.run.job`: a job of runs (benchmark, grid, worker processes, estimate);
- :mod:`~rnndrop.lm.run.report`: progress, metrics.csv, tables and plots;
- :mod:`~rnndrop.lm.run.process_group`: ``torchrun``'s process group, shards and reductions.

Depends on :mod:`rnndrop.lm.data` and :mod:`rnndrop.lm.model`; the command line
(:mod:`rnndrop.lm.cli`) sits on top.
"""
