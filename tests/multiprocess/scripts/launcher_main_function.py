"""Launches a function defined in this very script (``__main__``), as a user's script would.

Each task re-runs this file as ``__mp_main__``: the guarded block below does not run again.
"""

import sys


def work(word):
    print(f"{word} ran as {__name__}")


if __name__ == "__main__":
    from phalanx.cluster import launch

    sys.exit(launch(work, workers=2, args=["it"], timeout=60))
