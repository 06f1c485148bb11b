"""Penn Treebank word-level language modelling: no dropout vs naive vs tied variational.

The same command as ``rnndrop-lm ptb`` (see ``rnndrop-lm ptb --help`` and
rnndrop/lm/cli/), kept for scripts that call this file. Quick start on the PTB
sample shipped with the package (no internet needed):

    python benchmarks/ptb.py --data sample

Fair comparison (each regime's dropout chosen on validation, three seeds):

    python benchmarks/ptb.py --data sample --grid --seeds 1,2,3

Full PTB (downloaded once when --data is left out), e.g. Gal & Ghahramani's medium model:

    python benchmarks/ptb.py --config gal-medium --regimes naive,tied,untied --device cuda
"""

import sys

from rnndrop.lm.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["ptb", *sys.argv[1:]]))
