import sys

from ucm_proxy.cli import main

sys.exit(main())
