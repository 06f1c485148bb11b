"""``python -m rnndrop.lm``: the ``rnndrop-lm`` command (see :mod:`rnndrop.lm.cli`)."""

from rnndrop.lm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
