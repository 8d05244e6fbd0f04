"""`python -m kvcs_demo` (with scripts/ on PYTHONPATH): the demo; see demo.py."""

import sys

from kvcs_demo.demo import main

sys.exit(main())
