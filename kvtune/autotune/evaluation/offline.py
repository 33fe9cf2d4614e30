"""The suite is local files: lm-eval, datasets and transformers must never reach the hub.

Imported first by the package (before lm-eval loads `datasets`, which reads these variables
once, at import).
"""

import os

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")

for _name in OFFLINE_VARIABLES:
    os.environ[_name] = "1"
