import sys

from kvcs_soak.soak import main

sys.exit(main())
