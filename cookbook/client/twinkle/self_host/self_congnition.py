"""The product docs' file name (sic) for self_cognition.py in this folder; it runs that example."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("self_cognition.py")), run_name="__main__")
