import os

from hypothesis import settings

# CI runs derandomized so a red build is reproducible; locally examples vary per run.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
