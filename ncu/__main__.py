import sys

from ncu.cli import main

sys.exit(main())
