"""Where the repository is, for tests that read its files (deploy configs, scripts, the bench)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
