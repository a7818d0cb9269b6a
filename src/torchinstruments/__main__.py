"""`python -m torchinstruments finalize|show|compare|plot|heatmap` (also `torchinstruments`).

The command line lives in `torchinstruments.cli` (`main`); this module only runs it.
"""

from __future__ import annotations

import sys

from torchinstruments.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
