"""WikiText-2 word-level language modelling: no dropout vs naive vs tied variational.

    python benchmarks/wikitext2.py --data ../shared/data/wikitext-2-mini --config mini

Without --data the official wikitext-2-v1.zip is downloaded once into the cache.
Same options as benchmarks/ptb.py (``--help``).
"""

import sys

from rnndrop.lm.benchmark import main

if __name__ == "__main__":
    sys.stdout.write(main(dataset="wikitext-2"))
