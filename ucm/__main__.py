import sys

from ucm.cli import main

sys.exit(main())
