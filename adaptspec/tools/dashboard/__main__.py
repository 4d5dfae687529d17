import sys

from adaptspec.tools.dashboard import main

sys.exit(main())
