"""Property tests draw the same examples on every run (derandomized), so a random draw cannot
fail a landing and a failure reproduces on the next run; `HYPOTHESIS_PROFILE=explore` draws
afresh, to look for new counterexamples."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("fixed", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))
