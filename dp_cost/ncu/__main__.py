import sys

from dp_cost.ncu.cli import main

sys.exit(main())
