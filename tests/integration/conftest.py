import sys
from pathlib import Path

# The independent NumPy reference of the definition lives with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
