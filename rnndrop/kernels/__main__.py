"""``python -m rnndrop.kernels``: build the compiled loop kernel ahead of its first use (or load
it from torch's extension cache) and say where it lives; while it compiles, a progress line every
few seconds."""

import argparse
import logging
import sys

from rnndrop.kernels import compiled

if __name__ == "__main__":
    # no options: --help says what it does, and any other argument is an error, not a build
    argparse.ArgumentParser(prog="python -m rnndrop.kernels", description=__doc__).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module = compiled.build()
    except RuntimeError as error:
        how = getattr(error, "how", None)
        sys.exit(f"rnndrop: {error}" + (f". To get it: {how}." if how else ""))
    print(f"the compiled loop kernel is built and cached: {module.__file__}")
