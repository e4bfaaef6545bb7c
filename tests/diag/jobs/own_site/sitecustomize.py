"""The user's own start-up code: it must still run under nsa-diag watch."""

import os

os.environ["USER_SITECUSTOMIZE"] = "ran"
