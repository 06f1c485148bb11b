"""Penn Treebank word-level language modelling: no dropout vs naive vs tied variational.

Quick start on the small offline corpus:

    python benchmarks/ptb.py --data ../shared/data/ptb-mini --config mini

Fair comparison (each regime's dropout chosen on validation, three seeds):

    python benchmarks/ptb.py --data ../shared/data/ptb-mini --config mini --grid --seeds 1,2,3

Full PTB (downloaded once when --data is left out), e.g. Gal & Ghahramani's medium model:

    python benchmarks/ptb.py --config gal-medium --regimes naive,tied,untied --device cuda

See ``python benchmarks/ptb.py --help`` and rnndrop/lm/benchmark.py.
"""

import sys

from rnndrop.lm.benchmark import main

if __name__ == "__main__":
    sys.stdout.write(main(dataset="ptb"))
