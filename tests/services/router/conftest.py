"""Router tests share in-process fakes (router_fakes.py). pytest runs with
--import-mode=importlib, which puts no test folder on sys.path, so this folder is added here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
