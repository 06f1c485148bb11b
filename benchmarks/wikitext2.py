"""WikiText-2 word-level language modelling: no dropout vs naive vs tied variational.

The same command as ``rnndrop-lm wikitext2`` (``--help`` lists the options):

    python benchmarks/wikitext2.py --data sample

Without --data the official wikitext-2-v1.zip is downloaded once into the cache.
"""

import sys

from rnndrop.lm.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["wikitext2", *sys.argv[1:]]))
